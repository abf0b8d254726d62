"""Shared helpers of the benchmark drivers and workers.

Standard library only at import (drivers import it before any re-exec); MLX and MPI are
imported inside ``worker_main`` alone.

- ``worker_main(work)``: the entry of every benchmark worker run under mpiexec;
- ``machine()``: the machine description every figure is published with;
- ``run_json(cmd)``: run a command (usually ``mpiexec ...``), sample the memory of its
  process tree while it runs, and return the JSON object its last stdout line holds,
  plus wall time, the load average, and how many cores *other* processes used meanwhile
  (the machine is shared: a figure measured while someone else computed is flagged);
- small statistics and Markdown helpers.

Timings in the drivers are always ratios of configurations measured side by side, in
alternating rounds, reported as medians: nothing here is a pass/fail test.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
PYTHON = sys.executable
BIN = os.path.dirname(sys.executable)
MPIEXEC = shutil.which("mpiexec", path=BIN + os.pathsep + os.environ.get("PATH", ""))
SPMD_CP = shutil.which("spmd-cp", path=BIN + os.pathsep + os.environ.get("PATH", ""))
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- the machine -------------------------------------------------------------------
def machine() -> dict:
    """CPU, cores, memory, software versions: printed next to every table."""
    import importlib.metadata as md

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines()
                          if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        cpu = fields.get("model name", cpu)
        if "cpu family" in fields:  # a guest's model name may hide which generation it is
            cpu += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    except OSError:
        pass
    versions = {}
    for name in ("mlx", "mlx-lm", "mpi4py", "mpich", "numpy"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    sys.path.insert(0, str(ROOT))
    from spmd_cp import blas  # stdlib only

    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": blas.usable_cpus(),
            "memory_gb": round(PAGE * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "blas": blas.find_fast_blas(), "simd": simd_flags(),
            "blas_kernels": blas_kernels(blas.find_fast_blas()), **versions}


# The instruction sets the kernels here or the BLAS may take (as /proc/cpuinfo names them).
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx_vnni", "amx_tile", "asimd", "sve")


def simd_flags() -> list[str]:
    """Which of SIMD_FLAGS this CPU has (empty where /proc/cpuinfo is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith(("flags", "Features"))), [])
    except OSError:
        return []
    return [flag for flag in SIMD_FLAGS if flag in flags]


def blas_kernels(path: str | None) -> str | None:
    """The kernels the OpenBLAS at ``path`` picks for this CPU (its core name: by CPUID,
    or as OPENBLAS_CORETYPE forces), or None for another BLAS."""
    import ctypes

    try:
        lib = ctypes.CDLL(path) if path else None
    except OSError:
        return None
    if lib is None or not hasattr(lib, "openblas_get_corename"):
        return None
    lib.openblas_get_corename.restype = ctypes.c_char_p
    return (lib.openblas_get_corename() or b"").decode(errors="replace") or None


def machine_line(info: dict | None = None) -> str:
    info = info or machine()
    kernels = f" ({info['blas_kernels']} kernels)" if info.get("blas_kernels") else ""
    simd = " ".join(info.get("simd") or []) or "none recorded"
    return (f"{info['cpu']}, {info['cores']} cores, {info['memory_gb']} GB, Linux "
            f"{info['kernel']}, Python {info['python']}, mlx {info['mlx']}, mlx-lm "
            f"{info['mlx-lm']}, MPICH wheel {info['mpich']}, BLAS {info['blas']}{kernels}; "
            f"SIMD {simd}")


def loadavg() -> tuple[float, float, float]:
    with open("/proc/loadavg") as f:
        return tuple(float(x) for x in f.read().split()[:3])


def busy_seconds() -> float:
    """CPU seconds all processes have used since boot (/proc/stat, every core)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_wait: float = 0.0, threshold: float = 0.3) -> float:
    """Wait up to ``max_wait`` s for a 1 s window in which others use < threshold cores.

    Returns the cores others used in the last window (the machine is shared)."""
    deadline = time.monotonic() + max_wait
    used = 0.0
    while True:
        before, own = busy_seconds(), time.process_time()
        time.sleep(1.0)
        used = busy_seconds() - before - (time.process_time() - own)
        if used < threshold or time.monotonic() >= deadline:
            return used


# -- process trees -------------------------------------------------------------------
def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def proc_status(pid: int) -> dict:
    """VmRSS and VmHWM (bytes) and the command line of a live process ({} if gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            out["cmd"] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return {}
    return out


class TreeSampler:
    """Samples RSS of ``pid`` and every python process below it every ``interval`` s.

    ``peak``: pid -> highest VmHWM seen; ``series``: (t, {pid: VmRSS}, extra()) tuples.
    Ranks are told apart by pid; ``rank_pids()`` orders them by start (launch order),
    which for mpiexec on one host is not guaranteed to be rank order: use it for
    per-process figures, not to name ranks.
    """

    def __init__(self, pid: int, interval: float = 0.2, extra=None, match="python"):
        self.pid, self.interval, self.extra, self.match = pid, interval, extra, match
        self.peak: dict[int, int] = {}
        self.cmds: dict[int, str] = {}
        self.series: list = []
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.start_time = time.perf_counter()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def sample(self):
        rss = {}
        for p in [self.pid] + descendants(self.pid):
            st = proc_status(p)
            if not st or self.match not in st.get("cmd", "") or "VmRSS" not in st:
                continue
            self.seen.add(p)
            self.cmds[p] = st["cmd"]
            rss[p] = st["VmRSS"]
            self.peak[p] = max(self.peak.get(p, 0), st.get("VmHWM", 0), st["VmRSS"])
        extra = self.extra() if self.extra else None
        self.series.append((time.perf_counter() - self.start_time, rss, extra))

    def _run(self):
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def peaks(self) -> list[int]:
        """Peak RSS of the sampled processes, largest first (the re-exec keeps the pid)."""
        return sorted(self.peak.values(), reverse=True)


# -- running a measurement -------------------------------------------------------------
def bench_env(threads: int | None = 1, **extra) -> dict:
    """The environment for a measured child: fixed BLAS threads, no stray preload."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "SPMD_CP_BLAS_REEXEC") and not k.endswith("_NUM_THREADS")}
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = str(threads)
    env.update({k: str(v) for k, v in extra.items()})
    return env


QUIET_WAIT = float(os.environ.get("BENCH_QUIET_WAIT", "20"))


def run_json(cmd: list[str], env: dict | None = None, timeout: float = 3600,
             sample_memory: bool = True, check: bool = True, cwd=None,
             quiet_wait: float | None = None, keep_stderr: bool = False) -> dict:
    """Run ``cmd``; return its last stdout line as JSON plus what was measured around it.

    Added keys: ``_wall_s``, ``_load`` (1-min load average before, after), ``_others``
    (cores other processes used during the run), ``_rss_peaks`` (peak RSS per python
    process of the tree, bytes), ``_returncode``, ``_stderr`` (tail, on failure or with
    ``keep_stderr``).
    Before starting, waits up to ``quiet_wait`` s (default $BENCH_QUIET_WAIT, 20) for
    the other processes on the machine to go quiet; it does not wait longer than that.
    """
    wait_for_quiet(QUIET_WAIT if quiet_wait is None else quiet_wait)
    load0, busy0, kids0 = loadavg()[0], busy_seconds(), children_cpu()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)
    sampler = TreeSampler(proc.pid) if sample_memory else None
    if sampler:
        sampler.__enter__()
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException as error:
        # A launcher that hangs (an mpiexec that never starts its proxies) or a Ctrl-C
        # must not leave the run's processes behind: its own session, ended as a whole.
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        if isinstance(error, subprocess.TimeoutExpired):
            raise RuntimeError(f"{' '.join(map(str, cmd))} did not finish in {timeout:.0f} "
                               f"s:\n{err[-4000:]}\n{out[-2000:]}") from None
        raise
    finally:
        if sampler:
            sampler.__exit__(None, None, None)
    wall = time.perf_counter() - start
    others = max(0.0, (busy_seconds() - busy0) - (children_cpu() - kids0)) / max(wall, 1e-9)
    lines = [line for line in out.strip().splitlines() if line.startswith("{")]
    result: dict = {}
    if lines:
        try:
            result = json.loads(lines[-1])
        except ValueError:
            result = {}
    if check and (proc.returncode != 0 or not result):
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n"
                           f"{err[-4000:]}\n{out[-2000:]}")
    result.update(_wall_s=wall, _load=[load0, loadavg()[0]], _others=round(others, 2),
                  _rss_peaks=sampler.peaks() if sampler else [], _returncode=proc.returncode)
    if keep_stderr or proc.returncode != 0 or not lines:
        result["_stderr"] = err[-4000:]
    return result


def llama_cpp_greedy(model: str, prompt: str, threads: int, tokens: int,
                     n_batch: int = 512, n_ctx: int = 0) -> dict:
    """(In a child process of its own) llama.cpp's prefill of the text in file ``prompt``
    (``n_batch`` tokens a batch; llama-cpp-python's default) and ``tokens`` greedy tokens
    one at a time, on ``threads`` threads: the figures the drivers set beside spmd-cp's
    ``--json``. ``n_ctx``: its context (0: the model's, whose KV cache it allocates)."""
    from llama_cpp import Llama

    text = Path(prompt).read_text()
    llm = Llama(model_path=model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=n_batch, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=True)
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    answer = [llm.sample(temp=0.0)]
    prefilled = time.perf_counter()
    for _ in range(tokens - 1):
        llm.eval([answer[-1]])
        answer.append(llm.sample(temp=0.0))
    done = time.perf_counter()
    return {"prompt_tokens": len(ids), "ttft_s": prefilled - start,
            "prefill_tok_s": len(ids) / (prefilled - start),
            "decode_tok_s": (tokens - 1) / (done - prefilled),
            "text": llm.detokenize(answer).decode(errors="replace"),
            "llama_cpp_python": __import__("llama_cpp").__version__}


def mpi_cmd(ranks: int, *args) -> list[str]:
    return [MPIEXEC, "-n", str(ranks), *map(str, args)]


def spmd_cp_command(ranks: int, args: list[str], cluster: bool = False) -> list[str]:
    """``spmd-cp ARGS`` on ``ranks`` ranks: through mpiexec here, or with ``cluster`` on
    the simulated hosts of ``launch/netns-cluster`` (through launch/spmd-cp-run, one BLAS
    thread a rank)."""
    program = str(Path(BIN) / "spmd-cp")
    if cluster:
        return [sys.executable, str(ROOT / "launch" / "spmd-cp-run"), "--netns-cluster",
                "-n", str(ranks), "--threads", "1", "--program", program, "--", *args]
    return mpi_cmd(ranks, program, *args)


# -- statistics and output ------------------------------------------------------------
def median(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def fmt(x, digits=2) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return f"{x:.{digits}f}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save(name: str, payload: dict, markdown: str | None = None) -> Path:
    """Write results/<name>.json (and .md with the printed tables)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    if markdown is not None:
        (RESULTS / f"{name}.md").write_text(markdown + "\n")
    return path


def from_root(path: str) -> str:
    """A path as a result file records it: relative to the repository root. An absolute
    path names one machine's directories; a relative one reruns from any checkout laid
    out alike (another checkout beside it: ``../spmd-cp-COMMIT``)."""
    return os.path.relpath(os.path.abspath(path), ROOT)


def portable_text(text: str, **places: str | Path) -> str:
    """``text`` (captured output, a process's command line) as a result file records it:
    this interpreter's environment written ``$VENV``, each of ``places`` (a run's scratch
    folder, say) ``$NAME``, the repository ``.``: no directory only one machine had."""
    for name, path in sorted({"VENV": sys.prefix, **places}.items(),
                             key=lambda item: -len(str(item[1]))):
        text = text.replace(str(path), f"${name.upper()}")
    return text.replace(str(ROOT), ".")


def command_line(script: str, argv: list[str]) -> str:
    """The command a result file records: ``python benchmarks/SCRIPT ARGS``, every
    absolute path among the arguments (alone, or after ``NAME=`` or ``--flag=``) made
    relative to the repository root (``from_root``)."""
    def portable(arg: str) -> str:
        head, sep, value = arg.rpartition("=")
        return head + sep + from_root(value) if value.startswith("/") else arg

    return f"python benchmarks/{script} " + shlex.join(portable(arg) for arg in argv)


def header(title: str, command: str) -> str:
    """The preamble of every printed report: command, machine, load, time."""
    l1, l5, l15 = loadavg()
    return (f"## {title}\n\ncommand: `{command}`\n\nmachine: {machine_line()}\n\n"
            f"report written {time.strftime('%Y-%m-%d %H:%M:%S')}, load average then "
            f"{l1:.2f} / {l5:.2f} / {l15:.2f} (1/5/15 min; includes the benchmark's own "
            "ranks: see the per-run 'others' cores' for outside load)\n")


# -- the worker side (under mpiexec) ------------------------------------------------------
@dataclass
class Worker:
    """What every benchmark worker is handed: the communicator and the loaded model."""

    comm: object  # spmd_cp.runtime.comm.Comm
    loaded: object  # spmd_cp.models.loader.LoadedModel: .model (mlx-lm), .tokenizer
    model: object  # the CPModel over loaded.model

    @staticmethod
    def random_ids(length: int, seed: int = 0):
        """Random token ids (below 20000: ordinary text tokens of every model used here)."""
        import numpy as np

        return np.random.RandomState(seed).randint(3, 20000, size=length)


def worker_main(work, model_path: str | None = None):
    """Run ``work(Worker)`` on every rank as the spmd-cp entry point runs a command.

    First the optimized-BLAS re-exec (before MPI starts), then spmd.run_main: a watchdog
    bounds every blocking call and any rank's failure aborts the whole job non-zero,
    so a broken benchmark never hangs. Exits with the job's code.
    """
    from spmd_cp.blas import ensure_fast_blas

    ensure_fast_blas()
    from spmd_cp.engine.model import CPModel
    from spmd_cp.models.loader import default_model_path, load_model
    from spmd_cp.runtime import spmd

    def main(comm, _options):
        loaded = load_model(model_path or default_model_path())
        work(Worker(comm, loaded, CPModel(loaded.model)))

    sys.exit(spmd.run_main(main, {}))


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')} load {loadavg()[0]:.2f}] {msg}", file=sys.stderr,
          flush=True)
