"""Failure behaviour on real MPI jobs: every fault ends the whole job, fast, saying where.

Faults are injected with the test-only hidden flag --fault (spmd_cp/runtime/faults.py) at a
given rank, phase and layer; times are measured from the moment the fault fires.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from conftest import MPIEXEC, RANK_ENV, SPMD_CP

PROMPT = "Tell me about the history of the city. " * 20


def launch_with_fault(n: int, args: list[str], fault: str | None, timeout: float = 120,
                      trigger: str | None = None, on_trigger=None):
    """Run spmd-cp on n ranks; return (returncode, stderr, seconds from trigger to exit).

    The trigger is the first stderr line containing ``trigger`` (default: the fault's own
    traceback or message); ``on_trigger(proc)`` runs then (e.g. to send SIGINT).
    """
    env = {**os.environ, **RANK_ENV}
    if fault:
        args = [*args, "--fault", fault]
    proc = subprocess.Popen([MPIEXEC, "-n", str(n), *SPMD_CP, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    lines, fired = [], []

    def read():
        for line in proc.stderr:
            lines.append(line)
            if not fired and trigger and trigger in line:
                fired.append(time.monotonic())
                if on_trigger:
                    on_trigger(proc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        reader.join(5)
        pytest.fail(f"job did not end within {timeout}s; stderr:\n{''.join(lines)[-4000:]}")
    ended = time.monotonic()
    reader.join(5)
    stderr = "".join(lines)
    assert fired, f"trigger {trigger!r} never appeared; stderr:\n{stderr[-4000:]}"
    return proc.returncode, stderr, ended - fired[0]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults") / "prompt.txt"
    path.write_text(PROMPT)
    return str(path)


def generate_args(model, prompt_file, *extra):
    return ["generate", "--model", model, "--prompt-file", prompt_file, "--max-tokens", "6",
            "--cp-algo", "pass-kv", *extra]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_exception_on_one_rank_ends_the_job_with_its_traceback(phase, tiny_models, prompt_file):
    code, stderr, seconds = launch_with_fault(
        3, generate_args(tiny_models["llama"], prompt_file), f"raise:rank=1:phase={phase}:layer=1",
        trigger="injected fault")
    assert code != 0
    assert f"[rank 1/3] RuntimeError: injected fault on rank 1 at {phase} layer 1" in stderr
    assert "[rank 1/3] Traceback" in stderr
    assert seconds < 10


def test_rank_killed_mid_prefill_ends_the_job(tiny_models, prompt_file):
    code, stderr, seconds = launch_with_fault(
        3, generate_args(tiny_models["llama"], prompt_file, "-v"),
        "kill:rank=2:phase=prefill:layer=1", trigger="prefill attention")
    assert code != 0
    assert seconds < 60


def test_hung_rank_is_named_by_the_watchdog(tiny_models, prompt_file):
    code, stderr, seconds = launch_with_fault(
        3, generate_args(tiny_models["llama"], prompt_file, "--comm-timeout", "4", "-v"),
        "hang:rank=2:phase=prefill:layer=1", trigger="prefill attention")
    assert code != 0
    messages = [line for line in stderr.splitlines() if "--comm-timeout 4" in line]
    assert messages, stderr[-3000:]
    assert "rank 2 has not communicated" in messages[0]
    assert "stuck in prefill layer 1" in messages[0]
    assert seconds < 4 + 15


def test_ctrl_c_stops_every_rank_promptly(tiny_models, prompt_file):
    # A long generation; SIGINT to mpiexec once decoding has started (as Ctrl-C would).
    args = ["generate", "--model", tiny_models["llama"], "--prompt-file", prompt_file,
            "--max-tokens", "4000", "--max-context", "8192", "-v"]
    code, stderr, seconds = launch_with_fault(
        2, args, None, trigger="prefill attention",
        on_trigger=lambda proc: (time.sleep(1.0), os.kill(proc.pid, signal.SIGINT)))
    assert code == 130, stderr[-3000:]
    assert "interrupted; stopping all ranks" in stderr
    assert seconds < 1.0 + 10


def test_full_disk_output_is_a_clear_error(tiny_models, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text(PROMPT)
    args = ["score", "--model", tiny_models["llama"], "--text-file", str(text), "--output",
            "/dev/full"]
    proc = subprocess.run([MPIEXEC, "-n", "2", *SPMD_CP, *args], capture_output=True, text=True,
                          env={**os.environ, **RANK_ENV}, timeout=120)
    assert proc.returncode != 0
    assert "spmd-cp: error: cannot write /dev/full" in proc.stderr
    assert "No space left on device" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_memory_forecast_refuses_and_names_what_fits(embedded_model, prompt_file):
    # 200 MiB per rank: the weights alone (538 MB as float32) do not fit, so
    # --shard-weights auto shards them; their packed half (0.1 GB) and the rank process's
    # own resident memory (about 0.15 GB) do not fit either.
    proc = subprocess.run([MPIEXEC, "-n", "2", *SPMD_CP, "generate", "--prompt-file",
                           prompt_file, "--memory-limit", "200MB"],
                          capture_output=True, text=True, env={**os.environ, **RANK_ENV},
                          timeout=120)
    assert proc.returncode == 2
    error = [line for line in proc.stderr.splitlines() if line.startswith("spmd-cp: error:")]
    assert len(error) == 1
    assert "over the limit of 200.00 MB per rank" in error[0] and "+ process 0." in error[0]
    assert "it fits with" in error[0] or "no rank count fits" in error[0]


def test_memory_forecast_counts_the_process_outside_mlx(embedded_model):
    """The forecast is of resident memory: what the rank process holds besides MLX's
    arrays (measured in this process: interpreter, libraries) adds to the total, and a
    limit the arrays alone would meet is refused with the part named."""
    from spmd_cp.engine.cache.forecast import check_fits, forecast_rank_bytes
    from spmd_cp.engine.model import kv_model_shape
    from spmd_cp.errors import UserError
    from spmd_cp.models.loader import load_model
    from spmd_cp.runtime.resident import outside_mlx_bytes, resident_bytes, resident_peak_bytes

    shape = kv_model_shape(load_model(embedded_model))
    process = outside_mlx_bytes()
    assert 0 < process < resident_bytes() <= resident_peak_bytes()
    arrays = forecast_rank_bytes(shape, 10**8, 1024, 1024, 2)
    whole = check_fits(shape, 10**8, 1024, 1024, 2, arrays.total + process, "pass-kv",
                       process_bytes=process)
    assert whole.total == arrays.total + process and whole.process == process
    with pytest.raises(UserError, match=r"\+ process \d+\.\d\d\), over the limit"):
        check_fits(shape, 10**8, 1024, 1024, 2, arrays.total, "pass-kv", process_bytes=process)


def test_ranks_with_different_model_files_are_refused(tmp_path, prompt_file):
    """Rank 1 has another copy of the 'same' model (other weights): one command on both
    ranks (--model model), each rank in its own working directory, as two hosts would
    hold two files at one path."""
    from conftest import write_tiny_model

    write_tiny_model(tmp_path / "a" / "model", "llama", seed=1)
    write_tiny_model(tmp_path / "b" / "model", "llama", seed=2)
    common = ["generate", "--prompt-file", str(prompt_file), "--max-tokens", "2",
              "--model", "model"]
    cmd = [MPIEXEC, "-n", "1", "-wdir", str(tmp_path / "a"), *SPMD_CP, *common, ":",
           "-n", "1", "-wdir", str(tmp_path / "b"), *SPMD_CP, *common]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **RANK_ENV},
                          timeout=120)
    assert proc.returncode == 2
    error = [line for line in proc.stderr.splitlines() if line.startswith("spmd-cp: error:")]
    assert len(error) == 1, proc.stderr[-3000:]
    assert "ranks disagree on model file checksum" in error[0]
    assert "rank 0:" in error[0] and "rank 1:" in error[0]
    assert time.monotonic() - start < 60
