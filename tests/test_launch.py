"""Tests for the launch tooling: launch/spmd-cp-run, launch/netns-cluster, launch/netns-exec.

The dry-run tests check the command the wrapper writes for each MPI.  The MPICH one uses
the real mpiexec from the venv; the Open MPI one puts a fake `mpirun` first on PATH that
only prints an Open MPI version banner: that exercises the detection logic, nothing else
is faked.  The last test builds a real 2-host cluster out of network namespaces, runs a
2-rank mpi4py job on it through the wrapper and checks that the ranks ran on different
"hosts" and that the bytes crossed the veth links (skipped where namespaces cannot be
created).  Every subprocess has a timeout; a timeout fails with the child's stderr.
"""

import json
import os
import shlex
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "launch", "spmd-cp-run")
CLUSTER = os.path.join(ROOT, "launch", "netns-cluster")
NETNS_EXEC = os.path.join(ROOT, "launch", "netns-exec")
VENV_BIN = os.path.dirname(sys.executable)      # where the venv's mpiexec lives

# A cluster name and subnet of its own, so the test never touches a cluster someone
# brought up with the defaults (spmdcp, 10.77.0.0/24).
PREFIX = "spmdcpt"
SUBNET = "10.79.0"


def run(cmd, timeout=30, env=None, check=True):
    """subprocess.run with a timeout that fails the test with the child's stderr."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
        pytest.fail(f"timed out after {timeout}s: {shlex.join(cmd)}\n"
                    f"--- stderr ---\n{err}\n--- stdout ---\n{out}")
    if check and proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {shlex.join(cmd)}\n"
                    f"--- stderr ---\n{proc.stderr}\n--- stdout ---\n{proc.stdout}")
    return proc


def base_env(path_first=None, **extra):
    env = dict(os.environ)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "SLURM_JOB_ID",
                "SLURM_CPUS_PER_TASK", "SPMD_CP_MPIRUN", "SPMDCP_NETNS_PREFIX"):
        env.pop(var, None)
    dirs = ([path_first] if path_first else []) + [VENV_BIN, env.get("PATH", "")]
    env["PATH"] = os.pathsep.join(dirs)
    env.update(extra)
    return env


def dry_run(args, env):
    """Run the wrapper with --dry-run; return (argv of the printed command, stderr)."""
    proc = run([sys.executable, RUN, "--dry-run", *args], env=env)
    lines = [ln for ln in proc.stderr.splitlines() if ln and not ln.startswith("#")]
    assert len(lines) == 1, proc.stderr          # exactly one line: the command itself
    return shlex.split(lines[0]), proc.stderr


def option_values(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def genv(argv):
    """MPICH -genv NAME VALUE pairs as a dict."""
    return {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "-genv"}


def xenv(argv):
    """Open MPI -x NAME=VALUE pairs as a dict (bare -x NAME maps to None)."""
    out = {}
    for v in option_values(argv, "-x"):
        k, _, val = v.partition("=")
        out[k] = val if _ else None
    return out


def mca(argv):
    return {argv[i + 1]: argv[i + 2] for i, a in enumerate(argv) if a == "--mca"}


# ------------------------------------------------------------------ dry runs -------------

def test_mpich_dry_run_converts_openmpi_hostfile_and_sets_iface_env(tmp_path):
    hostfile = tmp_path / "macs.openmpi"
    hostfile.write_text("# two Macs\nmac1 slots=2   # first\n\nmac2 slots=3 max_slots=4\n")
    argv, err = dry_run(["--hostfile", str(hostfile), "--iface", "127.0.0.0/8", "--",
                         "generate", "--prompt", "hello world", "--json"], base_env())

    assert os.path.basename(argv[0]) in ("mpirun", "mpiexec")
    assert "MPICH (Hydra)" in err
    # The Open MPI file was rewritten in Hydra's host:n format (comments dropped).
    (converted,) = option_values(argv, "-f")
    assert converted != str(hostfile)
    entries = [ln for ln in open(converted).read().splitlines() if not ln.startswith("#")]
    assert entries == ["mac1:2", "mac2:3"]
    # -n defaults to the total slot count; the program is spmd-cp with its args intact.
    i = argv.index("-n")
    assert argv[i + 1] == "5"
    assert argv[i + 2:] == ["spmd-cp", "generate", "--prompt", "hello world", "--json"]
    # The CIDR was resolved to the local interface holding an address in it (lo).
    assert option_values(argv, "-iface") == ["lo"]
    env = genv(argv)
    assert env["FI_TCP_IFACE"] == "lo" and env["UCX_NET_DEVICES"] == "lo"
    # No core binding; BLAS threads = cores / ranks on the busiest host (3 on mac2).
    assert option_values(argv, "-bind-to") == ["none"]
    cores = len(os.sched_getaffinity(0))
    assert env["OPENBLAS_NUM_THREADS"] == env["OMP_NUM_THREADS"] == str(max(1, cores // 3))
    # Open MPI-only flags must not leak into an MPICH command line.
    assert not {"--oversubscribe", "--allow-run-as-root", "-x", "--mca"} & set(argv)


def test_mpich_dry_run_keeps_user_thread_settings_and_exec_mode(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.0.0.1:1\n10.0.0.2:1\n")
    argv, _ = dry_run(["-n", "2", "--hostfile", str(hostfile), "--env", "FOO=bar baz",
                       "--exec", "--", "python", "-c", "print(1)"],
                      base_env(OPENBLAS_NUM_THREADS="7"))
    assert option_values(argv, "-f") == [str(hostfile)]      # already MPICH: used as is
    env = genv(argv)
    assert env["OPENBLAS_NUM_THREADS"] == "7"                # set by the user: kept
    assert env["FOO"] == "bar baz"
    assert argv[-5:] == ["-n", "2", "python", "-c", "print(1)"]


def test_dry_run_errors_are_reported(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.write_text("a slots=2\nb:2\n")
    proc = run([sys.executable, RUN, "--dry-run", "--hostfile", str(mixed)],
               env=base_env(), check=False)
    assert proc.returncode == 2 and "mixes" in proc.stderr
    # 198.51.100.0/24 is TEST-NET-2 (RFC 5737, documentation only): no interface has it.
    proc = run([sys.executable, RUN, "--dry-run", "-n", "2", "--iface", "198.51.100.0/24"],
               env=base_env(), check=False)
    assert proc.returncode == 2 and "no local interface" in proc.stderr


def fake_openmpi(tmp_path, version="5.0.3"):
    """A directory with an `mpirun` that prints Open MPI's version banner and records any
    other invocation (a dry run must never start the launcher)."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    marker = tmp_path / "launched"
    script = bindir / "mpirun"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then
            echo "mpirun (Open MPI) {version}"
            echo
            echo "Report bugs to https://www.open-mpi.org/community/help/"
            exit 0
        fi
        echo "$@" > {shlex.quote(str(marker))}
        exit 99
        """))
    script.chmod(0o755)
    return str(bindir), marker


def test_openmpi_dry_run_with_fake_banner(tmp_path):
    bindir, marker = fake_openmpi(tmp_path)
    hostfile = tmp_path / "macs.mpich"
    hostfile.write_text("# Hydra format\n169.254.10.1:1\n169.254.10.2:1\n")
    argv, err = dry_run(["--hostfile", str(hostfile), "--iface", "169.254.0.0/16",
                         "--oversubscribe", "-n", "4", "--", "bench"],
                        base_env(path_first=bindir))

    assert argv[0] == os.path.join(bindir, "mpirun")
    assert "Open MPI 5.0.3" in err
    (converted,) = option_values(argv, "--hostfile")
    entries = [ln for ln in open(converted).read().splitlines() if not ln.startswith("#")]
    assert entries == ["169.254.10.1 slots=1", "169.254.10.2 slots=1"]
    # Open MPI takes the CIDR as is, for both the MPI (btl) and runtime (oob) channels.
    m = mca(argv)
    assert m["btl_tcp_if_include"] == m["oob_tcp_if_include"] == "169.254.0.0/16"
    assert option_values(argv, "--bind-to") == ["none"]
    assert "--oversubscribe" in argv
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    x = xenv(argv)
    # 4 ranks on 2 one-slot hosts: 2 per host after oversubscription.
    cores = len(os.sched_getaffinity(0))
    assert x["OPENBLAS_NUM_THREADS"] == x["OMP_NUM_THREADS"] == str(max(1, cores // 2))
    assert "PATH" in x                                    # Open MPI does not forward env
    assert argv[-3:] == ["4", "spmd-cp", "bench"] and argv[-4] == "-n"
    assert not {"-genv", "-iface", "-f", "-bind-to"} & set(argv)
    assert not marker.exists()


# ------------------------------------------------------------------ netns cluster --------

def can_make_netns():
    try:
        probe = subprocess.run(["ip", "netns", "add", f"{PREFIX}-probe"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run `ip netns add`: {exc}"
    if probe.returncode != 0:
        return f"`ip netns add` failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", f"{PREFIX}-probe"], capture_output=True, timeout=10)
    return None


# Each rank: its namespace (inode of /proc/self/ns/net), the address it reaches the head
# node from, its hostname and MPI processor name, and whether the 4 MiB it received in a
# Sendrecv carried the peer's pattern; rank 0 prints all rows as one JSON line.
RANK_SCRIPT = textwrap.dedent("""\
    import json, os, socket, sys
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, peer = comm.Get_rank(), 1 - comm.Get_rank()
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((sys.argv[1], 9))          # UDP connect sends nothing; picks the source IP
    ip = s.getsockname()[0]
    n = 4 << 20
    send = np.full(n, 10 + rank, dtype=np.uint8)
    recv = np.zeros(n, dtype=np.uint8)
    comm.Sendrecv(send, dest=peer, recvbuf=recv, source=peer)
    row = {"rank": rank, "netns": os.stat("/proc/self/ns/net").st_ino, "ip": ip,
           "hostname": socket.gethostname(), "processor": MPI.Get_processor_name(),
           "recv_ok": bool((recv == 10 + peer).all()), "bytes": n}
    rows = comm.gather(row, root=0)      # one printer: ranks' stdout lines can interleave
    if rank == 0:
        print("RANKS " + json.dumps(rows), flush=True)
    """)


def veth_counters(k):
    base = f"/sys/class/net/{PREFIX}-v{k}/statistics"
    return {d: int(open(f"{base}/{d}_bytes").read()) for d in ("tx", "rx")}


def leftovers():
    ns = run(["ip", "netns", "list"]).stdout
    links = run(["ip", "-o", "link", "show"]).stdout
    return ([ln for ln in ns.splitlines() if ln.startswith(PREFIX + "-")]
            + [ln for ln in links.splitlines() if f" {PREFIX}-" in ln]
            + [p for p in (f"/tmp/{PREFIX}-netns", f"/etc/netns/{PREFIX}-h0") if os.path.exists(p)])


def test_netns_cluster_real_two_rank_job(tmp_path):
    reason = can_make_netns()
    if reason:
        pytest.skip(reason)
    cluster = [CLUSTER, "--prefix", PREFIX]
    env = base_env(TMPDIR="/tmp")
    try:
        # `up` twice: the second recreates the cluster instead of failing.
        run(cluster + ["up", "2", "--subnet", SUBNET, "--rate", "4gbit"], env=env)
        up = run(cluster + ["up", "2", "--subnet", SUBNET, "--rate", "8gbit"], env=env)
        hostfile = up.stdout.strip().splitlines()[-1]
        assert open(hostfile).read().split() == [f"{SUBNET}.1:1", f"{SUBNET}.2:1"]
        status = run(cluster + ["status"], env=env).stdout
        assert f"{PREFIX}-h1" in status and "8Gbit" in status

        # The ssh stand-in lands in the right namespace, with that host's name.
        out = run([NETNS_EXEC, "-x", f"{SUBNET}.2", "hostname"], env=env).stdout.strip()
        assert out == f"{PREFIX}-h1"

        script = tmp_path / "rank.py"
        script.write_text(RANK_SCRIPT)
        before = [veth_counters(k) for k in (0, 1)]
        proc = run([sys.executable, RUN, "--netns-cluster", "--netns-prefix", PREFIX,
                    "--exec", "--", sys.executable, str(script), f"{SUBNET}.254"],
                   env=env, timeout=60)
        after = [veth_counters(k) for k in (0, 1)]

        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RANKS ")]
        assert len(lines) == 1, proc.stdout + proc.stderr
        ranks = json.loads(lines[0][len("RANKS "):])
        assert [r["rank"] for r in ranks] == [0, 1], proc.stdout + proc.stderr
        # Two different network namespaces, neither of them the test's own.
        own_ns = os.stat("/proc/self/ns/net").st_ino
        assert ranks[0]["netns"] != ranks[1]["netns"]
        assert own_ns not in {r["netns"] for r in ranks}
        assert [r["ip"] for r in ranks] == [f"{SUBNET}.1", f"{SUBNET}.2"]
        assert [r["processor"] for r in ranks] == [f"{PREFIX}-h0", f"{PREFIX}-h1"]
        assert all(r["recv_ok"] for r in ranks)
        # The payload really crossed both veths, in both directions.  The root-side end
        # of host k's veth transmits what host k receives.
        n = ranks[0]["bytes"]
        for k in (0, 1):
            assert after[k]["tx"] - before[k]["tx"] >= n, (k, before, after)
            assert after[k]["rx"] - before[k]["rx"] >= n, (k, before, after)

        # The Open MPI spelling of the same launch (fake banner, dry run only).
        bindir, marker = fake_openmpi(tmp_path)
        argv, _ = dry_run(["--netns-cluster", "--netns-prefix", PREFIX, "--exec", "--",
                           "python", "x.py"], base_env(path_first=bindir, TMPDIR="/tmp"))
        m = mca(argv)
        assert m["plm_ssh_agent"] == NETNS_EXEC
        assert m["btl"] == "tcp,self" and m["btl_tcp_if_include"] == f"{SUBNET}.0/24"
        assert option_values(argv, "--hostfile") == [f"/tmp/{PREFIX}-netns/hosts.openmpi"]
        assert not marker.exists()
    finally:
        subprocess.run(cluster + ["down"], capture_output=True, timeout=30, env=env)
    # `down` is idempotent and leaves nothing behind.
    run(cluster + ["down"], env=env)
    assert leftovers() == []
