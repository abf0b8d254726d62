"""Real multi-host runs over the simulated TCP cluster (launch/netns-cluster, docs/LAUNCH.md).

`spmd-cp score`, `generate` and `batch` run through `launch/spmd-cp-run --netns-cluster` on 2
and 4 "hosts" (network namespaces joined by shaped veth links, MPICH over ofi/tcp) and must
give what one rank gives, and the bytes that crossed the links must be the bytes the ranks
counted in `comm_bytes`. Skipped, with the reason, where network namespaces cannot be made.

    python -m pytest -q tests/test_cluster.py      # as root; about 100 s on 2 busy cores
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import RANK_ENV, SPMD_CP, Launch, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "launch", "spmd-cp-run")
CLUSTER = os.path.join(ROOT, "launch", "netns-cluster")

# A cluster of this file's own (test_launch.py uses spmdcpt / 10.79.0, the default spmdcp /
# 10.77.0), so a cluster someone else brought up is never touched.
PREFIX = "spmdcpc"
SUBNET = "10.83.0"
HOSTS = 4  # 2-host runs use the first two (-n 2 fills one slot per host in file order)

# Prompt sizes: every pass-KV byte is attention traffic (K/V of (N-1)/N of the tokens per
# layer: ~22 MB per rank at 600 tokens on 4 ranks), against ~3-14 KB of fixed MPI traffic
# per launch, so a few hundred tokens already make the fixed part < 0.1 %. 600 rather than
# ~1,500 tokens keeps the file near 100 s on two shared cores (model loading on 4 ranks
# costs ~20 s there, and prefill over TCP ~2x one local rank).
SCORE_PARAGRAPHS = 5      # ~630 tokens
GENERATE_PARAGRAPHS = 3   # ~400 tokens with the chat template
MAX_TOKENS = 8
TIMEOUT = 150


def document(paragraphs: int) -> str:
    """Deterministic English-like text (10 sentences, ~125 tokens per paragraph)."""
    rng = random.Random(0)
    words = (["The river", "A small village", "The old library", "Our team", "The north wind",
              "A careful engineer", "The market", "Every student", "The lighthouse",
              "A quiet garden"],
             ["remembers", "carries", "protects", "measures", "describes", "follows",
              "changes", "welcomes", "explains", "collects"],
             ["the morning light", "stories of the sea", "a thousand maps", "the first snow",
              "old copper coins", "the sound of bells", "every lost letter",
              "the winter harvest", "seven blue stones", "the names of stars"],
             ["before the festival begins.", "while the city sleeps.", "as the tide returns.",
              "in the last week of autumn.", "without asking for anything.",
              "under a sky full of clouds.", "with great patience.", "long after the rain stops."])
    sentences = [" ".join(rng.choice(part) for part in words) for _ in range(10 * paragraphs)]
    return "\n\n".join(" ".join(sentences[i:i + 10]) for i in range(0, len(sentences), 10)) + "\n"


def cluster_env() -> dict:
    env = {**os.environ, **RANK_ENV, "TMPDIR": "/tmp"}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env.pop("SPMDCP_NETNS_PREFIX", None)
    return env


def run(cmd: list[str], timeout: float = TIMEOUT) -> Launch:
    """Run ``cmd`` in its own process group; on timeout kill the group and fail with stderr."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=cluster_env(), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s; stderr:\n{err[-5000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}; stderr:\n{err[-5000:]}")
    return Launch(subprocess.CompletedProcess(cmd, proc.returncode, out, err),
                  time.perf_counter() - start)


def on_cluster(n: int, argv: list[str], program: list[str] | None = None) -> Launch:
    """``spmd-cp argv`` (or, with ``program``, that whole command) on n simulated hosts."""
    wrapper = [sys.executable, RUN, "--netns-cluster", "--netns-prefix", PREFIX, "-n", str(n)]
    if program is None:
        return run(wrapper + ["--program", SPMD_CP[0], "--"] + argv)
    return run(wrapper + ["--exec", "--"] + program)


# -- what crossed the links ------------------------------------------------------------------
def _counter(device: str, name: str) -> int:
    with open(f"/sys/class/net/{device}/statistics/{name}") as f:
        return int(f.read())


def host_to_host_bytes() -> int:
    """Bytes the simulated hosts have sent to one another since the cluster came up.

    Host k's transmissions arrive on the root-side end of its veth, so they are that end's
    rx_bytes; summed over k, that is everything the hosts sent. Part of it went to the head
    node (the bridge address, where mpiexec runs): Hydra's PMI exchange, forwarded stdout and
    stderr. The bridge device counts exactly those frames in its own rx_bytes (frames it
    forwards between ports never touch its counters), so the difference is host-to-host
    traffic: the MPI traffic between ranks. Counted as frames: payload plus Ethernet, IP and
    TCP headers, plus ACKs.
    """
    sent = sum(_counter(f"{PREFIX}-v{k}", "rx_bytes") for k in range(HOSTS))
    return sent - _counter(f"{PREFIX}-br", "rx_bytes")


def wire_bytes_of(fn):
    """(result of fn(), host-to-host bytes during it)."""
    before = host_to_host_bytes()
    result = fn()
    return result, host_to_host_bytes() - before


# Connects every pair of ranks (as spmd-cp's collectives do) and moves one small object per
# pair: MPI_Init, connection set-up and teardown, MPI_Finalize, and nothing else.
BASELINE_SCRIPT = "from mpi4py import MPI; c = MPI.COMM_WORLD; c.alltoall([0] * c.size)"


def assert_wire_matches_counted(summary: dict, wire: int, baseline: int):
    """The accounting: wire - baseline = counted payload + per-byte overhead.

    - ``wire``: host-to-host frames during the run (``host_to_host_bytes``: the launcher's
      and stdout's traffic to the head node is already excluded, exactly).
    - ``baseline``: the same measure for a trivial launch of the same shape (same wrapper,
      same hosts, all rank pairs connected, no spmd-cp work): the fixed cost of starting,
      connecting and finalizing MPI between the ranks, 3-14 KB here.
    - what remains beyond ``comm_bytes`` grows with the payload: TCP/IP/Ethernet headers and
      ACKs (about 4.5 % per 1448-byte segment at MTU 1500 on a real NIC, but veth hands
      around 64 KB GSO super-frames with one set of headers, so here ~0.2-2 %), MPI's
      per-message headers, and small control messages spmd-cp does not count (the row
      counts before an Allgatherv, a send_array's shape header): together a few percent.
    So ``comm_bytes`` must be a lower bound (every counted byte crosses a link exactly once:
    each rank is on its own host) and within 10 % of what crossed.
    """
    counted = sum(summary["comm_bytes"])
    extra = wire - baseline
    detail = (f"counted {counted} B, host-to-host {wire} B, baseline {baseline} B, "
              f"(wire - baseline) / counted = {extra / max(counted, 1):.4f}")
    assert counted > 1_000_000, detail  # attention traffic, not control messages
    # 0.999: byte-exact payloads, but pickled control objects are counted with the default
    # pickle protocol while mpi4py sends protocol 5 (a few bytes either way).
    assert 0.999 * counted <= extra <= 1.10 * counted, detail
    print(f"\n{len(summary['comm_bytes'])} hosts: {detail}")  # shown with pytest -s


# -- fixtures ------------------------------------------------------------------------------------
def netns_unavailable() -> str | None:
    probe = f"{PREFIX}-probe"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"cannot run `ip netns add`: {error}"
    if made.returncode != 0:
        return f"`ip netns add` is not permitted here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


@pytest.fixture(scope="module")
def cluster():
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    command = [CLUSTER, "--prefix", PREFIX]
    try:
        up = subprocess.run(command + ["up", str(HOSTS), "--subnet", SUBNET], text=True,
                            capture_output=True, timeout=60, env=cluster_env())
        if up.returncode != 0:
            pytest.skip(f"launch/netns-cluster up {HOSTS} failed: {up.stderr.strip()[-2000:]}")
        yield
    finally:
        subprocess.run(command + ["down"], capture_output=True, timeout=60, env=cluster_env())


@pytest.fixture(scope="module")
def baseline(cluster):
    """Host-to-host bytes of the trivial launch, per rank count (measured once each)."""
    measured = {}

    def measure(n: int) -> int:
        if n not in measured:
            _, measured[n] = wire_bytes_of(
                lambda: on_cluster(n, [], program=[sys.executable, "-c", BASELINE_SCRIPT]))
        return measured[n]
    return measure


@pytest.fixture(scope="module")
def calibrated(cluster):
    """As a user would, run `spmd-cp doctor` on each host set first: it measures link and
    compute once and caches them, and generate's `--decode-tp auto` decides from that
    cache. The measured jobs then move only their own traffic (calibration's probes are
    not the job's and are kept out of comm_bytes, but they would cross the links)."""
    for n in (2, 4):
        on_cluster(n, ["doctor"])


@pytest.fixture(scope="module")
def texts(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    doc, prompt = root / "doc.txt", root / "prompt.txt"
    doc.write_text(document(SCORE_PARAGRAPHS))
    prompt.write_text(document(GENERATE_PARAGRAPHS)
                      + "\nWhich object does the lighthouse carry in the text above?\n")
    # Batch: two questions about one document (prefilled once, then truncated back to it
    # for the second question) and a job of its own.
    jobs = root / "jobs.jsonl"
    jobs.write_text("".join(json.dumps(job) + "\n" for job in [
        {"id": "q1", "prefix_file": "prompt.txt", "prompt": "Who remembers the first snow?"},
        {"id": "alone", "prompt": "Name three colors of the rainbow."},
        {"id": "q2", "prefix_file": "prompt.txt", "prompt": "What does the market collect?"}]))
    return {"root": root, "doc": str(doc), "prompt": str(prompt), "jobs": str(jobs)}


def score_argv(texts, output):
    return ["score", "--text-file", texts["doc"], "--output", str(output), "--json",
            "--cp-algo", "pass-kv"]


def generate_argv(texts):
    return ["generate", "--prompt-file", texts["prompt"], "--max-tokens", str(MAX_TOKENS),
            "--temp", "0", "--json", "--cp-algo", "pass-kv"]


def batch_argv(texts, output):
    return ["batch", "--jobs", texts["jobs"], "--output", str(output), "--max-tokens",
            str(MAX_TOKENS), "--json", "--cp-algo", "pass-kv", "--progress", "off"]


def read_lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def one_rank_score(texts):
    output = texts["root"] / "score-1.jsonl"
    summary = run_cli(1, score_argv(texts, output), env=RANK_ENV, timeout=TIMEOUT).last_json()
    return summary, read_lines(output)


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("hosts", [4])  # 2 hosts: generate's and batch's tests
def test_score_on_hosts_equals_one_rank_and_link_bytes_match(hosts, texts, one_rank_score,
                                                             baseline):
    fixed = baseline(hosts)
    output = texts["root"] / f"score-{hosts}.jsonl"
    launch, wire = wire_bytes_of(lambda: on_cluster(hosts, score_argv(texts, output)))
    summary = launch.last_json()
    assert summary["ranks"] == hosts and summary["algo"] == "pass-kv"
    expected_summary, expected = one_rank_score
    lines = read_lines(output)
    assert summary["tokens"] == expected_summary["tokens"] > 500
    assert [line["pos"] for line in lines] == [line["pos"] for line in expected]
    assert [line["token"] for line in lines] == [line["token"] for line in expected]
    assert [line["argmax"] for line in lines] == [line["argmax"] for line in expected]
    np.testing.assert_allclose([line["logprob"] for line in lines],
                               [line["logprob"] for line in expected], rtol=0, atol=1e-4)
    assert all(b > 0 for b in summary["comm_bytes"]) and len(summary["comm_bytes"]) == hosts
    assert_wire_matches_counted(summary, wire, fixed)


@pytest.fixture(scope="module")
def one_rank_generate(texts):
    return run_cli(1, generate_argv(texts), env=RANK_ENV, timeout=TIMEOUT).last_json()


@pytest.mark.parametrize("hosts", [2, 4])
def test_generate_on_hosts_equals_one_rank_and_link_bytes_match(hosts, texts, one_rank_generate,
                                                                baseline, calibrated):
    expected = one_rank_generate
    fixed = baseline(hosts)
    launch, wire = wire_bytes_of(lambda: on_cluster(hosts, generate_argv(texts)))
    summary = launch.last_json()
    assert summary["ranks"] == hosts and summary["algo"] == "pass-kv"
    assert summary["prompt_tokens"] == expected["prompt_tokens"] > 300
    assert summary["tokens"] == expected["tokens"] == MAX_TOKENS
    assert summary["text"] == expected["text"]
    # Only rank 0 writes stdout: the streamed text, then the JSON line.
    assert launch.stdout.startswith(expected["text"])
    assert_wire_matches_counted(summary, wire, fixed)


@pytest.mark.parametrize("hosts", [2])  # 4 hosts: generate's and score's tests
def test_batch_on_hosts_equals_one_rank_and_link_bytes_match(hosts, texts, baseline,
                                                             calibrated):
    expected_out = texts["root"] / "batch-1.jsonl"
    if not expected_out.exists():
        run_cli(1, batch_argv(texts, expected_out), env=RANK_ENV, timeout=TIMEOUT)
    expected = read_lines(expected_out)
    fixed = baseline(hosts)
    output = texts["root"] / f"batch-{hosts}.jsonl"
    launch, wire = wire_bytes_of(lambda: on_cluster(hosts, batch_argv(texts, output)))
    summary = launch.last_json()
    assert summary["ranks"] == hosts and summary["answered"] == 3 and summary["errors"] == 0
    lines = read_lines(output)
    assert [line["id"] for line in lines] == ["q1", "alone", "q2"]
    assert [line["prefix_reused"] for line in lines] == [False, False, True]
    for line, reference in zip(lines, expected):
        for field in ("id", "text", "tokens", "prompt_tokens", "prompt_tokens_prefilled"):
            assert line[field] == reference[field], (field, line, reference)
    assert lines[2]["prompt_tokens_reused"] > 300  # the document came from the cache
    assert_wire_matches_counted(summary, wire, fixed)
