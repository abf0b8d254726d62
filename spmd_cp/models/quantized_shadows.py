"""Quantized shadows: decode's matrix-vector products read a quantized model's packed weights.

A quantized model's matrices (GGUF's block types, MLX's affine 4- and 8-bit) are
dequantized to float32 at load on the CPU (MLX's quantized matmul is slow there), and
every decode step then reads 4 bytes a weight where the file held 5/8 of a byte.
kernels/gemv_forward.c, which already takes MLX's matrix-vector products ahead of the BLAS,
can instead read the packed form and dequantize in registers. Each float32 matrix is
registered with its packed form ("shadow"); the C side checks at registration that the
packed form dequantizes to the matrix's float32 values bit for bit and refuses it
otherwise. A product then has exactly the float32 matrix's weights and differs from
sgemv's only in the order of its sums (float32 rounding, as between two BLAS builds).

Two forms: MLX's affine triple (``Packed``: an MLX directory's 4- and 8-bit matrices),
read with AVX2, FMA and F16C only; a GGUF file's own blocks (``Blocks``: Q4_0 to Q8_0,
Q2_K to Q6_K, IQ4_NL, IQ4_XS; kernels/gguf_blocks.h; one stream, where MLX's form of
Q4_0/Q4_1/Q8_0 is three), memory-mapped, read with AVX2 and F16C or in plain C.

Shadows follow the decode step's slices: a view of whole rows of a registered matrix is
found by its address; a copy (the split step's column slices of o and down, its joined
q/k/v rows) is registered with a view of the matching part of the packed form
(``register_columns``, ``register_stacked``): no packed bytes beyond the model's. A
column slice that does not fall on group or block boundaries (for the K-quants and
IQ4_XS, 256 inputs) has no shadow: decode reads its float32 copy.

Registered arrays are kept for the life of the process: the C side holds their
addresses. ``--no-quantized-decode`` turns shadows off (decode reads float32).
Without the forward preloaded (macOS, a GPU, no C compiler, ``SPMD_CP_GEMV_FORWARD=0``)
nothing registers and nothing changes; without AVX2, FMA and F16C only ``Blocks`` do.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import time
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..runtime.resident import note_released
from .packed_forms import GROUP_KINDS, Blocks, Packed  # noqa: F401 (imported from here too)

log = logging.getLogger("spmd_cp")

MADV_DONTNEED = 4  # Linux's madvise advice
KERNEL_BITS = (4, 8)  # the bit widths gemv_forward.c's kernel reads
# GGUF types whose blocks gemv_forward.c reads as they are (gguf_blocks.h)
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS")
# spmd_cp_shadow_register's answers (gemv_forward.c)
FUSED, UNFUSED, DIFFERS, UNSUPPORTED, FULL, OVERLAPS = 1, 0, -1, -2, -3, -4
REFUSALS = {DIFFERS: "its packed form does not reproduce the float32 weights",
            UNSUPPORTED: "a bit width, group size or row width the kernel does not read",
            FULL: "the registry is full",
            OVERLAPS: "its memory is registered already"}


@functools.lru_cache(maxsize=1)
def _library():
    """The preloaded forward's registration entry points (kernels/gemv_forward.c), or
    None: (affine register, block register, products, whether affine shadows register
    here: an x86 CPU with AVX2, FMA and F16C, {"release", "fill", "rows"})."""
    try:
        scope = ctypes.CDLL(None)
        register = scope.spmd_cp_shadow_register
        register_blocks = scope.spmd_cp_block_shadow_register
        products = scope.spmd_cp_shadow_products
        affine = bool(scope.spmd_cp_shadow_usable())
    except (OSError, AttributeError):
        return None
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    register.restype = integer
    register.argtypes = [pointer, integer, integer, integer, integer, pointer, ctypes.c_size_t,
                         pointer, pointer, ctypes.c_size_t, integer, pointer, pointer, integer]
    products.restype = ctypes.c_longlong
    products.argtypes = []
    register_blocks.restype = integer
    register_blocks.argtypes = [pointer, integer, integer, integer, pointer, ctypes.c_size_t,
                                pointer, pointer, integer]
    extras = {}  # release, fill, rows: a released matrix (gemv_forward.c)
    for name, result, arguments in (("release", ctypes.c_longlong, [pointer]),
                                    ("fill", integer, [pointer]),
                                    ("rows", integer, [pointer, integer, pointer, integer,
                                                       pointer])):
        extras[name] = function = getattr(scope, f"spmd_cp_shadow_{name}")
        function.restype, function.argtypes = result, arguments
    return register, register_blocks, products, affine, extras


def available() -> bool:
    """Whether load_model can register shadows for a quantized file's matrices (on the
    CPU, with the forward preloaded; ``--no-quantized-decode`` asks it not to)."""
    return mx.default_device() == mx.cpu and _library() is not None


def reads_affine() -> bool:
    """Whether MLX's affine triples (an MLX directory's 4- and 8-bit) register
    here: ``available`` on an x86 CPU with AVX2, FMA and F16C."""
    return available() and _library()[3]


def availability() -> str:
    """One line for doctor: whether decode reads quantized models' packed weights here."""
    if mx.default_device() != mx.cpu:
        return "not used (the GPU computes quantized weights as they are)"
    if _library() is None:
        return "not available (needs the sgemv forward, built and preloaded on Linux)"
    if not _library()[3]:
        return ("on (GGUF's blocks, in plain C; not MLX's 4- and 8-bit affine weights: "
                "they need AVX2, FMA and F16C)")
    return "on (GGUF's blocks and MLX's 4- and 8-bit affine weights read packed)"


def _rows(a: mx.array) -> np.ndarray | None:
    """A zero-copy numpy view of an evaluated 2-D array whose rows are each contiguous
    (a column slice's rows lie further apart than their width), or None."""
    mx.eval(a)
    view = np.asarray(a)
    if view.ndim != 2 or view.strides[1] != view.itemsize or view.strides[0] < 0:
        return None
    return view


@dataclass
class _Entry:
    address: int
    rows: int
    cols: int
    packed: Packed | Blocks
    released: bool = False


class Shadows:
    """The process's registered shadows (the C registry is per process too)."""

    def __init__(self):
        self._entries: list[_Entry] = []
        self._kept: list = []  # the float32 matrices: the C side reads their memory
        self.nbytes = 0  # packed forms held for the model's matrices (slices are views)
        self.refused: dict[str, int] = {}
        # Release every matrix as it registers (packed_load.py turns it on): the packed
        # forms are then the only copy of the weights.
        self.releasing = False
        self.released_count = 0  # a quick "none": most processes release nothing
        self.generation = 0  # counts registrations and releases (what caches of sizes key on)

    @property
    def active(self) -> bool:
        return bool(self._entries)

    def describe(self) -> str:
        """e.g. "quantized decode: 211 matrices read packed (96 MB)"."""
        refused = sum(self.refused.values())
        return (f"quantized decode: {len(self._entries)} matrices read packed "
                f"({self.nbytes / 1e6:.0f} MB)" + (f", {refused} refused" if refused else ""))

    def products(self) -> int:
        """Matrix-vector products the shadows served in this process so far."""
        library = _library()
        return int(library[2]()) if library else 0

    def register(self, matrix: mx.array, packed: Packed | Blocks,
                 check: np.ndarray | None = None) -> bool:
        """Register ``packed`` as the shadow of the float32 ``matrix`` (rows, cols, rows
        contiguous); False (counted in ``refused``) where the C side refuses it or cannot
        be asked. ``check``: the float32 values of the matrix's first rows, computed
        elsewhere, that the packed form must reproduce bit for bit (for a matrix whose
        memory holds no values yet and is released after: packed_load.py); default the
        matrix itself, every row."""
        library = _library() if available() else None
        if library is None or matrix.dtype != mx.float32 or matrix.ndim != 2:
            return False
        weights = _rows(matrix)
        if check is None:
            check = weights
        if weights is None or not weights.flags.c_contiguous or check.dtype != np.float32 \
                or not check.flags.c_contiguous or check.ndim != 2 or \
                check.shape[1] != matrix.shape[1] or not 0 < check.shape[0] <= matrix.shape[0]:
            return self._refuse("its layout does not match the float32 matrix")
        if isinstance(packed, Blocks):
            return self._register_blocks(library[1], weights, check, matrix, packed)
        if not library[3]:
            return False
        group_params = [packed.scales, packed.biases]
        if packed.scales.dtype == mx.bfloat16:  # no numpy type: its bits (a view, strides kept)
            group_params = [a.view(mx.uint16) for a in group_params]
        words, scales, biases = (_rows(a) for a in [packed.weight, *group_params])
        rows, cols = matrix.shape
        if words is None or scales is None or biases is None or \
                scales.strides != biases.strides or packed.cols != cols or \
                words.shape[0] != rows:
            return self._refuse("its layout does not match the float32 matrix")
        scratch = np.empty(cols, np.float32)
        answer = library[0](weights.ctypes.data, rows, cols, packed.bits, packed.group,
                            words.ctypes.data, words.strides[0], scales.ctypes.data,
                            biases.ctypes.data, scales.strides[0] // scales.itemsize,
                            GROUP_KINDS[packed.scales.dtype], scratch.ctypes.data,
                            check.ctypes.data, check.shape[0])
        return self._registered(answer, weights, matrix, packed)

    def _register_blocks(self, register, weights: np.ndarray, check: np.ndarray,
                         matrix: mx.array, packed: Blocks) -> bool:
        data = packed.data
        rows, cols = matrix.shape
        if data.dtype != np.uint8 or data.ndim != 2 or data.strides[1] != 1 or \
                data.strides[0] < data.shape[1] or data.shape[0] != rows or packed.cols != cols:
            return self._refuse("its layout does not match the float32 matrix")
        scratch = np.empty(cols, np.float32)
        answer = register(weights.ctypes.data, rows, cols, packed.kind, data.ctypes.data,
                          data.strides[0], scratch.ctypes.data, check.ctypes.data,
                          check.shape[0])
        return self._registered(answer, weights, matrix, packed)

    def _registered(self, answer: int, weights: np.ndarray, matrix: mx.array, packed) -> bool:
        if answer not in (FUSED, UNFUSED):
            return self._refuse(REFUSALS.get(answer, f"answer {answer}"))
        self._entries.append(_Entry(weights.ctypes.data, *matrix.shape, packed))
        self.generation += 1
        self._kept.append(matrix)
        if self.releasing:
            self.release(matrix)
        return True

    def release(self, matrix: mx.array):
        """Hand back a registered matrix's float32 memory: from here on its products
        read the packed form (a product of many rows tile by tile: gemv_forward.c) and
        its rows come from ``lookup``; its memory reads as zeros."""
        entry = self._entry_at(matrix)
        released = _library()[4]["release"](entry.address)
        if released < 0:
            raise ValueError("release of a matrix that is not registered")
        if not entry.released:
            entry.released = True
            self.released_count += 1
            self.generation += 1
            note_released(entry.rows * entry.cols * 4)

    def _entry_at(self, matrix: mx.array) -> _Entry:
        address = _rows(matrix).ctypes.data
        for entry in self._entries:
            if entry.address == address:
                return entry
        raise ValueError("not a registered matrix")

    def is_released(self, matrix: mx.array) -> bool:
        """Whether ``matrix`` (a registered matrix or a view of whole rows of one) holds
        no values of its own any more."""
        if not self.released_count:
            return False
        found = self._entry_of(matrix)
        return found is not None and found[0].released

    def held_bytes(self, arrays) -> int:
        """Bytes ``arrays`` hold: those of a released matrix (or rows of one) hold none."""
        return sum(0 if self.is_released(a) else a.nbytes for a in arrays)

    def _entry_of(self, matrix: mx.array) -> tuple[_Entry, np.ndarray] | None:
        """The registered matrix whose memory holds ``matrix``'s first element, and a
        view of ``matrix``; None where there is none."""
        if not self._entries or matrix.dtype != mx.float32 or matrix.ndim != 2:
            return None
        view = _rows(matrix)
        if view is None:
            return None
        for entry in self._entries:
            if 0 <= view.ctypes.data - entry.address < entry.rows * entry.cols * 4:
                return entry, view
        return None

    @contextmanager
    def filled(self, matrices: list):
        """The released ones of ``matrices`` hold their values again for the block (for
        code that copies parts of them), and are released again after it."""
        entries = [found[0] for m in matrices
                   if (found := self._entry_of(m)) is not None and found[0].released]
        for entry in entries:
            _library()[4]["fill"](entry.address)
        try:
            yield
        finally:
            for entry in entries:
                _library()[4]["release"](entry.address)

    def lookup(self, matrix: mx.array, ids: np.ndarray, out: np.ndarray | None = None):
        """Rows ``ids`` of a released matrix (an embedding's lookup) from its packed
        form: into ``out`` (len(ids), cols) float32, C-contiguous, or a new mx.array."""
        ids = np.ascontiguousarray(ids, np.int32).reshape(-1)
        into = out if out is not None else np.empty((ids.size, matrix.shape[1]), np.float32)
        if ids.size and _library()[4]["rows"](_rows(matrix).ctypes.data, matrix.shape[1],
                                              ids.ctypes.data, ids.size, into.ctypes.data):
            raise ValueError("rows of a matrix that is not registered")
        return out if out is not None else mx.array(into)

    def _refuse(self, why: str) -> bool:
        self.refused[why] = self.refused.get(why, 0) + 1
        return False

    def packed_of(self, matrix: mx.array) -> Packed | Blocks | None:
        """The packed form of a registered matrix, or of a view of whole rows of one."""
        found = self._entry_of(matrix)
        if found is None:
            return None
        (entry, view), (rows, cols) = found, matrix.shape
        first, in_row = divmod(view.ctypes.data - entry.address, entry.cols * 4)
        if in_row or cols != entry.cols or view.strides[0] != cols * 4 or \
                first + rows > entry.rows:
            return None
        return entry.packed.rows(first, first + rows)

    def register_columns(self, copy: mx.array, source: mx.array, start: int, stop: int):
        """Register a copy of inputs [start, stop) of ``source`` (a registered matrix or
        rows of one) with the same columns of its packed form (a view)."""
        packed = self.packed_of(source)
        packed = packed.columns(start, stop) if packed is not None else None
        if packed is not None:
            self.register(copy, packed)

    def register_stacked(self, copy: mx.array, sources: list[mx.array]):
        """Register a copy of ``sources`` stacked by rows piece by piece, each with its
        source's packed rows (the C side reads a product across the pieces)."""
        start = 0
        for source in sources:
            packed, rows = self.packed_of(source), source.shape[0]
            if packed is not None:
                self.register(copy[start:start + rows], packed)
            start += rows

    def timed_reads(self, matrices: list, comm, sample_bytes: int) -> tuple[int, float]:
        """(float32 bytes, seconds) of the products of those of ``matrices`` that have a
        shadow, one row each, as a decode step makes them: every rank at once after a
        barrier, the best of two rounds over the first ones that make up ``sample_bytes``
        of float32 (or all), scaled to all. Collective, the same answer on every rank so
        that all decide alike: the fewest bytes any rank reads packed, the longest time."""
        mine = [m for m in matrices if m.dtype == mx.float32 and m.ndim == 2 and
                self.packed_of(m) is not None]
        starts = np.cumsum([0] + [m.nbytes for m in mine])  # each one's float32 offset
        sample = [m for m, start in zip(mine, starts) if start < sample_bytes]
        rows = {m.shape[1]: mx.ones((1, m.shape[1]), mx.float32) for m in sample}
        mx.eval(list(rows.values()))
        best = float("inf") if mine else 0.0
        comm.barrier()
        for _ in range(2 if mine else 0):
            start = time.perf_counter()
            mx.eval([rows[m.shape[1]] @ m.T for m in sample])
            best = min(best, time.perf_counter() - start)
        scaled = best * starts[-1] / max(starts[len(sample)], 1)
        answers = comm.allgather_object((int(starts[-1]), scaled))
        return min(b for b, _ in answers), max(s for _, s in answers)


SHADOWS = Shadows()


def release_pages(array: mx.array):
    """Hand the whole pages of an evaluated array's memory back to the kernel (they read
    as zeros after): for an array whose values do not matter yet."""
    view = _rows(array)
    page = mmap.PAGESIZE
    first = -(-view.ctypes.data // page) * page
    last = (view.ctypes.data + view.nbytes) // page * page
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


@functools.lru_cache(maxsize=1)
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def embedding_rows(embedding, ids: mx.array) -> mx.array:
    """``embedding(ids)``, its rows read from the packed form where the float32 matrix
    was released (models/packed_load.py: its memory holds no values)."""
    # (an nn.Module is a dict of its parameters; a vocabulary-parallel one is not)
    table = embedding.get("weight") if isinstance(embedding, dict) else None
    if table is None or not SHADOWS.is_released(table):
        return embedding(ids)
    rows = SHADOWS.lookup(table, np.asarray(ids, np.int32))
    return rows.reshape(*ids.shape, table.shape[1])


def register_model(model, packed: dict) -> int:
    """Register every float32 parameter of ``model`` named in ``packed`` ({parameter name:
    Packed or Blocks}); the number registered. Logs what was refused, once."""
    from mlx.utils import tree_flatten

    if not packed:
        return 0
    registered = 0
    for name, array in tree_flatten(model.parameters()):
        if name in packed and SHADOWS.register(array, packed[name]):
            registered += 1
            SHADOWS.nbytes += packed[name].nbytes
    if SHADOWS.refused:
        why = "; ".join(f"{n} x {reason}" for reason, n in SHADOWS.refused.items())
        log.info("quantized decode: %d matrices read packed, refused: %s", registered, why)
    return registered
