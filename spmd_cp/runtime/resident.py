"""What this process holds in memory as the operating system counts it (resident memory).

MLX's figures (``mx.get_active_memory``, ``get_peak_memory``) count only its buffers. A
rank holds more: the interpreter and its libraries (MLX, numpy, MPI, the tokenizer's),
the tokenizer's tables, Python objects, freed heap the allocator keeps. On the 2-core
test machine a rank of a 4-token SmolLM2 answer held about 180 MiB outside MLX's buffers
(N = 2, replicated: resident peak 775 MiB, MLX's peak 595 MiB). The memory forecast adds
this part as measured in the running process, and ``--json`` reports the resident peak.
Where resident memory cannot be read (no /proc: macOS) the forecast counts MLX's arrays
alone, as it did before.

A packed-only model (models/packed_load.py) names each quantized matrix with an MLX
float32 buffer whose pages are handed back to the kernel: MLX counts those buffers as
active, the operating system does not. MLX's figures here (``mlx_active_bytes``,
``mlx_peak_bytes``) leave them out (``note_released``).

A GGUF's quantized matrices are the file's own blocks, memory-mapped (models/packed_load.py):
the forecast counts them as weights, and their pages, once read, are resident outside
MLX's buffers too; ``outside_mlx_bytes`` leaves the resident pages of such files out
(``note_mapped_weights``), so that they are not counted twice.

A server measures each request's own peak: Linux lets a process reset its high-water mark
(``/proc/self/clear_refs``), and ``/proc/self/status``'s VmHWM then counts from there.
getrusage's ru_maxrss cannot be reset that way: it also keeps the mark of every thread
that has exited (an HTTP handler thread) since the process began.
"""

from __future__ import annotations

import os
import resource
import sys

import mlx.core as mx


_released_bytes = 0  # of MLX's active buffers, those whose pages were handed back
_weight_files: set[str] = set()  # files mapped for weights the forecast counts as such


def note_released(nbytes: int):
    """``nbytes`` more of MLX's buffers hold no pages (a packed-only model's matrices).

    MLX's memory limit grows by as much. MLX throttles evaluation once its active
    buffers pass that limit (about 0.85 of the RAM on the CPU): each eval then waits on
    the tasks in flight, polling its allocator's lock. A model whose float32 names
    outgrow the RAM (Llama-3.1-8B's shapes: 30 GB of names on a 24 GB machine) ran every
    prefill that way: 3.2 tok/s for 133 tokens at N = 2, a third of the time in that
    polling; 7.5 tok/s with the limit raised by the released bytes (2-core AMD EPYC, by
    hand: the generate command benchmarks/big_packed_model.py runs). The headroom for
    real buffers is what it was."""
    global _released_bytes
    _released_bytes += nbytes
    mx.set_memory_limit(mx.get_memory_limit() + nbytes)


def mlx_active_bytes() -> int:
    """MLX's buffers in use, less those whose pages were handed back."""
    return max(0, int(mx.get_active_memory()) - _released_bytes)


def mlx_peak_bytes() -> int:
    """MLX's peak of buffers in use (since ``mx.reset_peak_memory``), less those whose
    pages were handed back (they stay in use from the load on)."""
    return max(0, int(mx.get_peak_memory()) - _released_bytes)


def resident_peak_bytes() -> int:
    """The most resident memory this process has held (VmHWM; getrusage's ru_maxrss,
    which Linux counts in KiB and macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def resident_bytes() -> int | None:
    """Resident memory now (Linux's /proc/self/statm), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def note_mapped_weights(path: str):
    """``path`` is memory-mapped for weights that the forecast counts as weights."""
    _weight_files.add(os.path.realpath(path))


def mapped_weight_bytes() -> int:
    """Resident bytes of the files ``note_mapped_weights`` named (their mappings' Rss in
    /proc/self/smaps; 0 where it cannot be read)."""
    if not _weight_files:
        return 0
    total, counting = 0, False
    try:
        with open("/proc/self/smaps") as smaps:
            for line in smaps:
                fields = line.split(None, 5)
                if not fields[0].endswith(":"):  # a mapping's header: range, ..., its file
                    counting = len(fields) == 6 and fields[5].strip() in _weight_files
                elif counting and fields[0] == "Rss:":
                    total += int(fields[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    return total


def outside_mlx_bytes() -> int:
    """Resident bytes this process holds besides MLX's buffers (in use or cached): what
    the memory forecast adds to its model of MLX's arrays. 0 where resident memory
    cannot be read (then the forecast counts MLX's arrays alone, as before)."""
    now = resident_bytes()
    if now is None:
        return 0
    return max(0, now - mlx_active_bytes() - mx.get_cache_memory() - mapped_weight_bytes())


def reset_resident_peak() -> bool:
    """Start the high-water mark of resident memory again from now (Linux 4.0 on); False
    where it cannot be reset (then ``high_water_bytes`` counts from the start)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def high_water_bytes() -> int:
    """The most resident memory since ``reset_resident_peak`` or the start (VmHWM), or
    getrusage's peak where /proc/self/status cannot be read."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return resident_peak_bytes()


def memory_now() -> dict:
    """This process's memory as the operating system and MLX count it (bytes); the peak
    since the last ``reset_resident_peak``."""
    return {"resident_bytes": resident_bytes() or 0,
            "resident_peak_bytes": high_water_bytes(),
            "mlx_active_bytes": mlx_active_bytes(),
            "mlx_cache_bytes": int(mx.get_cache_memory())}
