"""The communicator: thread-level check, ring neighbours, arrays that keep their dtype."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import SPMD_CP, TESTS, run_ranks

from spmd_cp.errors import UserError


def test_thread_level_below_multiple_is_refused_on_several_ranks_only():
    from mpi4py import MPI

    from spmd_cp.runtime.comm import require_thread_multiple

    for level in (MPI.THREAD_SINGLE, MPI.THREAD_FUNNELED, MPI.THREAD_SERIALIZED):
        with pytest.raises(UserError, match="MPI_THREAD_MULTIPLE"):
            require_thread_multiple(level, MPI.THREAD_MULTIPLE, 2)
        require_thread_multiple(level, MPI.THREAD_MULTIPLE, 1)  # one rank: no second thread
    require_thread_multiple(MPI.THREAD_MULTIPLE, MPI.THREAD_MULTIPLE, 4)
    # The MPI these tests run on passes the check (as every multi-rank test relies on).
    require_thread_multiple(MPI.Query_thread(), MPI.THREAD_MULTIPLE, 2)


@pytest.mark.parametrize("n", [2, 3])
def test_arrays_keep_their_dtype_between_ranks_and_the_ring_closes(n, tmp_path):
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, str(TESTS))
    from comm_driver import as_record, payload

    out = tmp_path / "comm.json"
    run_ranks(n, [sys.executable, str(TESTS / "comm_driver.py"), str(out)], timeout=120)
    result = json.loads(out.read_text())
    from mpi4py import MPI

    assert result["thread_level"] >= MPI.THREAD_MULTIPLE
    ranks = result["ranks"]
    assert [r["next"] for r in ranks] == [(r + 1) % n for r in range(n)]
    assert [r["prev"] for r in ranks] == [(r - 1) % n for r in range(n)]
    for r in ranks:
        # What this rank received is exactly what its ring predecessor built, dtype too.
        expected = {name: as_record(a) for name, a in payload(r["prev"]).items()}
        assert r["received"] == expected, r["rank"]
        assert r["received"]["bfloat16"]["dtype"] == str(mx.bfloat16)
    # The reference is independent of the wire: bfloat16 bits of 0.5-step values.
    bits = np.array(mx.array([[0, 0.5, 1]], mx.float32).astype(mx.bfloat16).view(mx.uint16))
    assert ranks[1]["received"]["bfloat16"]["values"][0] == bits[0].tolist()


def test_an_mpi_without_thread_multiple_is_one_line_on_every_command(tmp_path):
    """mpi4py asked for MPI_THREAD_SERIALIZED (what a site's mpi4py.rc may set): the job
    stops before any work with exit 2 and one line, not a traceback per rank."""
    text = tmp_path / "doc.txt"
    text.write_text("A short document.\n")
    result = run_ranks(2, SPMD_CP + ["score", "--text-file", str(text),
                                     "--output", str(tmp_path / "out.jsonl")],
                       env={"MPI4PY_RC_THREAD_LEVEL": "serialized"}, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "MPI_THREAD_MULTIPLE" in lines[0], result.stderr
    assert not (tmp_path / "out.jsonl").exists()
