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

Two forms: MLX's affine triple (``Packed``: GGUF Q4_0/Q4_1/Q8_0 as MLX reads them, MLX's
own 4- and 8-bit), read with AVX2, FMA and F16C only; and the file's own blocks of GGUF's
other types (``Blocks``: Q5_0, Q5_1, Q2_K to Q6_K, IQ4_NL, IQ4_XS; kernels/gguf_blocks.h),
memory-mapped from the file, read with AVX2 and F16C where the CPU has them and by plain
C elsewhere.

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
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

log = logging.getLogger("spmd_cp")

KERNEL_BITS = (4, 8)  # the bit widths gemv_forward.c's kernel reads
# GGUF types whose blocks gemv_forward.c reads as they are (gguf_blocks.h)
BLOCK_TYPES = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
# spmd_cp_shadow_register's answers (gemv_forward.c)
FUSED, UNFUSED, DIFFERS, UNSUPPORTED, FULL, OVERLAPS = 1, 0, -1, -2, -3, -4
REFUSALS = {DIFFERS: "its packed form does not reproduce the float32 weights",
            UNSUPPORTED: "a bit width, group size or row width the kernel does not read",
            FULL: "the registry is full",
            OVERLAPS: "its memory is registered already"}


# How gemv_forward.c reads scales and biases (GROUP_FLOAT32, ...): widened to float32
# exactly, so a file's float16 or bfloat16 ones are kept as they are (half the bytes).
GROUP_KINDS = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}


@dataclass(frozen=True)
class Packed:
    """A matrix (rows, cols) in MLX's affine packing: ``weight`` uint32 (rows, cols * bits
    / 32), ``scales`` and ``biases`` (rows, cols / group) as float32, float16 or
    bfloat16; its weights are ``scale * q + bias`` in float32 arithmetic."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group: int

    @classmethod
    def of(cls, weight: mx.array, scales: mx.array, biases: mx.array, bits: int,
           group: int) -> Packed:
        if scales.dtype not in GROUP_KINDS or biases.dtype != scales.dtype:
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        return cls(weight, scales, biases, bits, group)

    def dequantized(self) -> mx.array:
        """The float32 matrix, in float32 arithmetic (scales and biases widened first)."""
        from .gguf import dequantize_float32

        return dequantize_float32(self.weight, self.scales, self.biases, self.bits, self.group)

    @property
    def cols(self) -> int:
        return self.weight.shape[1] * 32 // self.bits

    def rows(self, start: int, stop: int) -> Packed:
        return Packed(self.weight[start:stop], self.scales[start:stop],
                      self.biases[start:stop], self.bits, self.group)

    def columns(self, start: int, stop: int) -> Packed | None:
        """Inputs [start, stop), or None where the cut falls inside a group."""
        if start % self.group or stop % self.group:
            return None
        per_word = 32 // self.bits
        return Packed(self.weight[:, start // per_word:stop // per_word],
                      self.scales[:, start // self.group:stop // self.group],
                      self.biases[:, start // self.group:stop // self.group],
                      self.bits, self.group)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes


@dataclass(frozen=True)
class Blocks:
    """A matrix (rows, cols) as a GGUF file stores it in a type of ``BLOCK_TYPES``: ``data``
    uint8 (rows, row bytes), each row's blocks contiguous (a column slice's rows lie
    further apart than their width), ``kind`` the GGML type id."""

    data: np.ndarray
    kind: int
    cols: int

    @property
    def block(self) -> tuple[int, int]:
        from .gguf_types import block_of

        return block_of(self.kind)

    def rows(self, start: int, stop: int) -> Blocks:
        return Blocks(self.data[start:stop], self.kind, self.cols)

    def columns(self, start: int, stop: int) -> Blocks | None:
        """Inputs [start, stop), or None where a cut falls inside a block."""
        values, size = self.block
        if start % values or stop % values:
            return None
        return Blocks(self.data[:, start // values * size:stop // values * size], self.kind,
                      stop - start)

    @property
    def nbytes(self) -> int:
        return self.data.shape[0] * self.data.shape[1]


@functools.lru_cache(maxsize=1)
def _library():
    """The preloaded forward's registration entry points (kernels/gemv_forward.c), or
    None: (affine register, block register, products, whether affine shadows register
    here: an x86 CPU with AVX2, FMA and F16C)."""
    try:
        scope = ctypes.CDLL(None)
        register = scope.spmd_cp_shadow_register
        register_blocks = scope.spmd_cp_block_shadow_register
        products = scope.spmd_cp_shadow_products
        affine = bool(scope.spmd_cp_shadow_usable())
    except (OSError, AttributeError):
        return None
    register.restype = ctypes.c_int
    register.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                         ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    products.restype = ctypes.c_longlong
    products.argtypes = []
    register_blocks.restype = ctypes.c_int
    register_blocks.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return register, register_blocks, products, affine


def available() -> bool:
    """Whether load_model can register shadows for a quantized file's matrices (on the
    CPU, with the forward preloaded; ``--no-quantized-decode`` asks it not to)."""
    return mx.default_device() == mx.cpu and _library() is not None


def reads_affine() -> bool:
    """Whether MLX's affine triples (GGUF Q4_0/Q4_1/Q8_0, MLX's 4- and 8-bit) register
    here: ``available`` on an x86 CPU with AVX2, FMA and F16C."""
    return available() and _library()[3]


def availability() -> str:
    """One line for doctor: whether decode reads quantized models' packed weights here."""
    if mx.default_device() != mx.cpu:
        return "not used (the GPU computes quantized weights as they are)"
    if _library() is None:
        return "not available (needs the sgemv forward, built and preloaded on Linux)"
    if not _library()[3]:
        return ("on (GGUF's K-quant, Q5 and IQ4 blocks, in plain C; not 4- and 8-bit "
                "affine weights: they need AVX2, FMA and F16C)")
    return "on (4- and 8-bit weights and GGUF's K-quant, Q5 and IQ4 blocks read packed)"


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


class Shadows:
    """The process's registered shadows (the C registry is per process too)."""

    def __init__(self):
        self._entries: list[_Entry] = []
        self._kept: list = []  # the float32 matrices: the C side reads their memory
        self.nbytes = 0  # packed forms held for the model's matrices (slices are views)
        self.refused: dict[str, int] = {}

    @property
    def active(self) -> bool:
        return bool(self._entries)

    def describe(self) -> str:
        """e.g. "quantized decode: 271 matrices read packed (98 MB)"."""
        refused = sum(self.refused.values())
        return (f"quantized decode: {len(self._entries)} matrices read packed "
                f"({self.nbytes / 1e6:.0f} MB)" + (f", {refused} refused" if refused else ""))

    def products(self) -> int:
        """Matrix-vector products the shadows served in this process so far."""
        library = _library()
        return int(library[2]()) if library else 0

    def register(self, matrix: mx.array, packed: Packed | Blocks) -> bool:
        """Register ``packed`` as the shadow of the float32 ``matrix`` (rows, cols, rows
        contiguous); False (counted in ``refused``) where the C side refuses it or cannot
        be asked."""
        library = _library() if available() else None
        if library is None or matrix.dtype != mx.float32 or matrix.ndim != 2:
            return False
        if isinstance(packed, Blocks):
            return self._register_blocks(library[1], matrix, packed)
        if not library[3]:
            return False
        weights = _rows(matrix)
        group_params = [packed.scales, packed.biases]
        if packed.scales.dtype == mx.bfloat16:  # no numpy type: its bits (a view, strides kept)
            group_params = [a.view(mx.uint16) for a in group_params]
        words, scales, biases = (_rows(a) for a in [packed.weight, *group_params])
        rows, cols = matrix.shape
        if weights is None or not weights.flags.c_contiguous or words is None or \
                scales is None or biases is None or scales.strides != biases.strides or \
                packed.cols != cols or words.shape[0] != rows:
            return self._refuse("its layout does not match the float32 matrix")
        scratch = np.empty(cols, np.float32)
        answer = library[0](weights.ctypes.data, rows, cols, packed.bits, packed.group,
                            words.ctypes.data, words.strides[0], scales.ctypes.data,
                            biases.ctypes.data, scales.strides[0] // scales.itemsize,
                            GROUP_KINDS[packed.scales.dtype], scratch.ctypes.data)
        return self._registered(answer, weights, matrix, packed)

    def _register_blocks(self, register, matrix: mx.array, packed: Blocks) -> bool:
        weights, data = _rows(matrix), packed.data
        rows, cols = matrix.shape
        if weights is None or not weights.flags.c_contiguous or data.dtype != np.uint8 or \
                data.ndim != 2 or data.strides[1] != 1 or data.strides[0] < data.shape[1] or \
                data.shape[0] != rows or packed.cols != cols:
            return self._refuse("its layout does not match the float32 matrix")
        scratch = np.empty(cols, np.float32)
        answer = register(weights.ctypes.data, rows, cols, packed.kind, data.ctypes.data,
                          data.strides[0], scratch.ctypes.data)
        return self._registered(answer, weights, matrix, packed)

    def _registered(self, answer: int, weights: np.ndarray, matrix: mx.array, packed) -> bool:
        if answer not in (FUSED, UNFUSED):
            return self._refuse(REFUSALS.get(answer, f"answer {answer}"))
        self._entries.append(_Entry(weights.ctypes.data, *matrix.shape, packed))
        self._kept.append(matrix)
        return True

    def _refuse(self, why: str) -> bool:
        self.refused[why] = self.refused.get(why, 0) + 1
        return False

    def packed_of(self, matrix: mx.array) -> Packed | Blocks | None:
        """The packed form of a registered matrix, or of a view of whole rows of one."""
        if not self._entries or matrix.dtype != mx.float32 or matrix.ndim != 2:
            return None
        view = _rows(matrix)
        if view is None:
            return None
        address, (rows, cols) = view.ctypes.data, matrix.shape
        for entry in self._entries:
            offset = address - entry.address
            if 0 <= offset < entry.rows * entry.cols * 4:
                first, in_row = divmod(offset, entry.cols * 4)
                if in_row or cols != entry.cols or view.strides[0] != cols * 4 or \
                        first + rows > entry.rows:
                    return None
                return entry.packed.rows(first, first + rows)
        return None

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

    def timed_reads(self, matrices: list, comm) -> tuple[int, float]:
        """(float32 bytes, seconds) of the products of those of ``matrices`` that have a
        shadow, one row each, as a decode step makes them: every rank at once after a
        barrier, the best of two rounds. Collective (every rank calls it), and the same
        answer on every rank, so that all decide alike: the fewest bytes any rank reads
        packed and the longest time (comm: runtime.comm.Comm)."""
        mine = [m for m in matrices if m.dtype == mx.float32 and m.ndim == 2 and
                self.packed_of(m) is not None]
        rows = {m.shape[1]: mx.ones((1, m.shape[1]), mx.float32) for m in mine}
        mx.eval(list(rows.values()))
        best = float("inf") if mine else 0.0
        comm.barrier()
        for _ in range(2 if mine else 0):
            start = time.perf_counter()
            mx.eval([rows[m.shape[1]] @ m.T for m in mine])
            best = min(best, time.perf_counter() - start)
        answers = comm.allgather_object((sum(m.nbytes for m in mine), best))
        return min(b for b, _ in answers), max(s for _, s in answers)


SHADOWS = Shadows()


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
