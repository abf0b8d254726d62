"""Text that is not valid Unicode, from the command line, files and JSON: one
``spmd-cp: error:`` line, exit 2, before the model loads, nothing written or claimed.

Bytes that are not UTF-8 in an argument reach Python as lone surrogates (U+DC80..U+DCFF);
the tokenizer would refuse them with a TypeError on rank 0 after the model loaded, and
the job would abort on every rank. The launches pass the raw bytes through mpiexec.
"""

from __future__ import annotations

import json

import pytest

from spmd_cp.text_input import InvalidText, check_text, decode_utf8, find_invalid_text

from conftest import run_cli

BAD_BYTES = b"caf\xe9 au lait"  # Latin-1's e-acute: not UTF-8


def test_the_rule_names_the_string_and_the_character():
    # Independent reference: what the UTF-8 codec itself accepts.
    for text in ("plain", "caf\u00e9", "\U0001F600", "nul\x00 and \ufffe"):
        text.encode("utf-8")
        assert check_text(text, "--prompt") == text
    with pytest.raises(InvalidText, match=r"^--prompt is not valid Unicode text: the byte "
                                          r"0xE9 at character 3 is not UTF-8$"):
        check_text(BAD_BYTES.decode("utf-8", "surrogateescape"), "--prompt")
    with pytest.raises(InvalidText, match=r"^--stop\[1\] .* lone surrogate U\+D800"):
        check_text(["fine", "hi \ud800"], "--stop")
    body = json.loads('{"messages": [{"role": "user", "content": "hi \\ud800"}]}')
    assert find_invalid_text(body) == ("messages[0].content",
                                       "a lone surrogate U+D800 at character 3")
    # A surrogate pair in JSON is one valid character.
    assert find_invalid_text(json.loads('{"s": "\\ud83d\\ude00"}')) is None
    deep = "x"
    for _ in range(100_000):  # no recursion: a deep value cannot exhaust the stack
        deep = [deep]
    assert find_invalid_text(deep) is None
    assert decode_utf8("caf\u00e9".encode(), "prompt file p") == "caf\u00e9"
    with pytest.raises(InvalidText, match="prompt file p is not UTF-8 text .*offset 3"):
        decode_utf8(BAD_BYTES, "prompt file p")


def assert_refused_before_loading(launch, flag: str):
    lines = [line for line in launch.stderr.splitlines() if line.strip()]
    assert launch.returncode == 2, launch.stderr
    assert "Traceback" not in launch.stderr and "Abort" not in launch.stderr, launch.stderr
    assert lines == [f"spmd-cp: error: {flag} is not valid Unicode text: the byte 0xE9 at "
                     f"character 3 is not UTF-8"], launch.stderr
    assert launch.stdout == ""


@pytest.mark.parametrize("flag", ["--prompt", "--system", "--stop"])
def test_generate_refuses_text_arguments_that_are_not_utf8(flag, tmp_path):
    args = {"--prompt": "Hello", "--system": None, "--stop": None}
    argv = ["generate", "--max-tokens", "2", "--save-cache", str(tmp_path / "saved")]
    for name, value in args.items():
        if name != flag and value is not None:
            argv += [name, value]
    argv += [flag, BAD_BYTES]
    launch = run_cli(2, argv, timeout=300, check=False)
    assert_refused_before_loading(launch, flag)
    assert list(tmp_path.iterdir()) == []  # no cache directory, no claim beside it


def test_batch_system_not_utf8_leaves_no_output_and_no_claim(tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(json.dumps({"id": "a", "prompt": "Hello"}) + "\n")
    output = tmp_path / "results.jsonl"
    launch = run_cli(2, ["batch", "--jobs", str(jobs), "--output", str(output),
                         "--max-tokens", "2", "--system", BAD_BYTES], timeout=300, check=False)
    assert_refused_before_loading(launch, "--system")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.jsonl"]
