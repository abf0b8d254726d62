"""Output paths (spmd_cp.cli.outputs), the typed settings and the shared sampling ranges,
in one process: real files, symlinks, hard links and devices."""

from __future__ import annotations

import os
import stat

import pytest

from spmd_cp.cli.jobs import read_jobs
from spmd_cp.cli.outputs import Output, check_outputs
from spmd_cp.runtime.files import write_text_atomically
from spmd_cp.config import (SAMPLING_RANGES, DecodeConfig, RunConfig, SamplingConfig,
                            from_options)
from spmd_cp.errors import UserError


def refused(outputs, inputs, overwrite=False) -> str:
    with pytest.raises(UserError) as error:
        check_outputs(outputs, inputs, overwrite)
    return str(error.value)


def unwritable_directory(tmp_path):
    """A directory this process cannot create files in, even as root (os.access says yes
    to root for every path: only trying to create a file tells)."""
    if os.geteuid() == 0:
        return "/proc"
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return str(locked)


def test_an_output_that_is_an_input_is_refused_through_links(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("the document")
    link = tmp_path / "link.txt"
    link.symlink_to(doc)
    hard = tmp_path / "hard.txt"
    os.link(doc, hard)
    for path in (doc, link, hard, tmp_path / "." / "doc.txt"):
        message = refused([Output("--output", str(path))], {"the text file": [str(doc)]},
                          overwrite=True)
        assert message == f"--output is the text file: {path}"
    assert doc.read_text() == "the document"
    # Two outputs naming one file.
    assert "--trace and --output are the same file" in refused(
        [Output("--output", str(tmp_path / "o")), Output("--trace", str(tmp_path / "o"))], {})


def test_existing_files_need_overwrite_and_cache_dirs_their_own_files(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("old")
    assert refused([Output("--output", str(out))], {}) == (
        f"output {out} exists; use --overwrite to replace it")
    check_outputs([Output("--output", str(out))], {}, overwrite=True)
    check_outputs([Output("--output", str(out), appended=True)], {}, overwrite=False)
    # A cache directory holding the prompt (and other files) is fine; one holding a
    # prompt cache is replaced only with --overwrite.
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "question.txt").write_text("q")
    save = Output("--save-cache", str(cache), directory=True,
                  writes=("meta.json", "rank-*-of-*.safetensors"))
    check_outputs([save], {"the prompt file": [str(cache / "question.txt")]}, overwrite=False)
    (cache / "rank-0-of-2.safetensors").write_bytes(b"x")
    assert "already holds rank-0-of-2.safetensors; use --overwrite" in refused([save], {})
    check_outputs([save], {}, overwrite=True)
    assert "is not a directory" in refused(
        [Output("--save-cache", str(out), directory=True)], {})
    # A device is written in place, never replaced: no --overwrite needed.
    check_outputs([Output("--output", "/dev/null")], {}, overwrite=False)


def test_unwritable_places_are_found_by_trying(tmp_path):
    locked = unwritable_directory(tmp_path)
    message = refused([Output("--output", f"{locked}/out.jsonl")], {})
    assert message.startswith(f"output is not writable: {locked}/out.jsonl")
    assert "not writable" in refused(
        [Output("--save-cache", f"{locked}/new/cache", directory=True)], {})
    assert refused([Output("--output", str(tmp_path / "no" / "out.jsonl"))], {}) == (
        f"output directory does not exist: {tmp_path / 'no'}")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".spmd-cp")]


def test_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    before = out.stat().st_ino
    write_text_atomically(str(out), (f"{i}\n" for i in range(3)))
    assert out.read_text() == "0\n1\n2\n"
    assert out.stat().st_ino != before  # renamed over, never rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]

    def failing():
        yield "partial\n"
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError):
        write_text_atomically(str(out), failing())
    assert out.read_text() == "0\n1\n2\n"  # the old content survives a failed write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
    with pytest.raises(UserError, match="cannot write /dev/full: No space left on device"):
        write_text_atomically("/dev/full", ["x" * 10000])


def test_settings_take_every_flag_and_one_default():
    run, sampling, decode = from_options(
        {"model_path": None, "temp": 0.5, "stop": ("a",), "decode_tp": "on", "verbose": True},
        RunConfig, SamplingConfig, DecodeConfig)
    assert run.verbose and sampling.temp == 0.5 and sampling.stop == ["a"]
    assert decode.decode_tp == "on" and DecodeConfig().decode_tp == "auto"
    with pytest.raises(TypeError, match="no_such_flag"):
        from_options({"no_such_flag": 1}, RunConfig)


def test_job_lines_obey_the_flags_ranges(tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"id": "a", "prompt": "x", "min_p": 1.5, "top_p": -0.1}\n')
    with pytest.raises(UserError) as error:
        read_jobs(jobs)
    assert "'min_p' must be a number in [0, 1], got 1.5" in str(error.value)
    assert "'top_p' must be a number in [0, 1], got -0.1" in str(error.value)
    assert SAMPLING_RANGES["temp"] == (0, None)


def test_a_device_that_refuses_every_write_is_refused_before_any_work(tmp_path):
    """/dev/full takes no byte: refused as a write there would fail; /dev/null and a FIFO
    nobody reads yet are taken as they are, without a byte written or a wait."""
    import threading

    assert refused([Output("--output", "/dev/full")], {}) == \
        "cannot write /dev/full: No space left on device"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    check_outputs([Output("--output", "/dev/null"), Output("--trace", str(fifo))], {}, False)
    received = []
    reader = threading.Thread(target=lambda: received.append(open(fifo, "rb").read()))
    reader.start()  # a reader now: the probe opens the FIFO, writes nothing, closes it
    while reader.is_alive() and not received:
        check_outputs([Output("--trace", str(fifo))], {}, False)
        reader.join(0.05)
    reader.join(10)
    assert received == [b""]
