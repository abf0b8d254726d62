"""What spmd-cp makes of each GGUF tensor type, and the one line that refuses the others.

Types by llama.cpp's names (the ``gguf`` package's ``GGMLQuantizationType``), in three kinds:

- ``AFFINE`` (Q4_0, Q4_1, Q8_0): blocks of 32 values ``q * d + m``, which is MLX's affine
  quantization with group size 32. Read as MLX's (weight, scales, biases) triple, bit
  for bit as ``mx.load`` makes it (``unpack_blocks``): dequantized in float32 arithmetic
  (gguf.dequantize_float32), or kept as MLX quantized layers (``--keep-quantized``).
  Decode's quantized shadows read their blocks as the file stores them, as below.
- ``FLOAT`` (F32, F16, BF16): widened to float32.
- ``DEQUANTIZED`` (Q5_0, Q5_1, the K-quants Q2_K to Q6_K, IQ4_NL, IQ4_XS): turned into
  float32 at load by the gguf package's dequantizer (``gguf.quants.dequantize``,
  llama.cpp's reference semantics), one tensor, or the rows a rank needs, at a time;
  decode's quantized shadows read their blocks as the file stores them
  (quantized_shadows.Blocks).

Files whose tensors are all of ``MX_LOAD`` are read by MLX's own GGUF reader (``mx.load``);
files with any other readable type tensor by tensor (tensor_files.GGUFFile).
"""

from __future__ import annotations

import functools

import numpy as np

AFFINE = ("Q4_0", "Q4_1", "Q8_0")
FLOAT = ("F32", "F16", "BF16")
DEQUANTIZED = ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
READ = FLOAT + AFFINE + DEQUANTIZED
MX_LOAD = ("F32", "F16") + AFFINE  # what MLX's GGUF reader reads


@functools.lru_cache(maxsize=None)
def _types():
    """{type id: (name, values per block, bytes per block)}, the gguf package's table
    (imported on first use: the header's metadata is read without it)."""
    from gguf import GGML_QUANT_SIZES

    return {int(kind): (kind.name, *GGML_QUANT_SIZES[kind]) for kind in GGML_QUANT_SIZES}


def name_of(kind: int) -> str:
    return _types()[kind][0] if kind in _types() else f"unknown ({kind})"


def block_of(kind: int) -> tuple[int, int]:
    """(values, bytes) of one block of type ``kind``; ValueError for an unknown type."""
    if kind not in _types():
        raise ValueError(f"unknown GGML type {kind}")
    return _types()[kind][1:]


def is_affine(kind: int) -> bool:
    return name_of(kind) in AFFINE


def affine_bits(kind: int) -> int:
    return 8 if name_of(kind) == "Q8_0" else 4


def mx_load_reads(kinds) -> bool:
    """Whether MLX's GGUF reader reads tensors of every type in ``kinds``."""
    return all(name_of(k) in MX_LOAD for k in kinds)


def refusal(tensors) -> str | None:
    """The one line refusing the first of ``tensors`` ((name, type id) pairs) whose type
    spmd-cp does not read, or None."""
    for name, kind in tensors:
        if name_of(kind) not in READ:
            return (f"tensor {name} has GGUF type {name_of(kind)}, which spmd-cp does not "
                    f"read (it reads: {', '.join(READ)})")
    return None


def byte_shape(shape: tuple, kind: int) -> tuple:
    """The uint8 shape of a tensor of ``shape`` (numpy order): its last axis in blocks."""
    values, size = block_of(kind)
    return (*shape[:-1], shape[-1] // values * size)


def to_float32(raw: np.ndarray, kind: int, shape: tuple) -> np.ndarray:
    """The bytes of a ``FLOAT`` or ``DEQUANTIZED`` tensor (or of whole rows of one) as
    float32 of ``shape``, by the gguf package's reference dequantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(raw.reshape(byte_shape(shape, kind)), GGMLQuantizationType(kind))
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


UNPACK_ROWS = 8192  # rows unpacked at a time: the temporaries of a 262,144-row embedding


def unpack_rows(blocks: np.ndarray, kind: int):
    """``unpack_blocks`` of many rows, ``UNPACK_ROWS`` at a time into the outputs, so its
    temporaries stay those of a few thousand rows."""
    rows, groups = blocks.shape[:2]
    per_word = 32 // affine_bits(kind)
    out = (np.empty((rows, groups * 32 // per_word), np.uint32),
           np.empty((rows, groups), np.float16), np.empty((rows, groups), np.float16))
    for start in range(0, rows, UNPACK_ROWS):
        for whole, part in zip(out, unpack_blocks(blocks[start:start + UNPACK_ROWS], kind)):
            whole[start:start + UNPACK_ROWS] = part
    return out


def unpack_blocks(blocks: np.ndarray, kind: int):
    """(rows, blocks, block bytes) ``AFFINE`` blocks -> MLX (weight uint32, scales, biases).

    MLX packs value k of each group at bits ``bits * k`` of little-endian uint32 words;
    GGML's Q4 blocks hold value j in the low nibble of byte j and value j + 16 in its
    high nibble. Offsets: Q4_0 stores q - 8, Q8_0 signed bytes (MLX's are unsigned, so
    +128: the top bit flipped); -8 d and -128 d are exact in float16.
    """
    rows, groups = blocks.shape[:2]
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    name = name_of(kind)
    if name == "Q8_0":
        values = np.ascontiguousarray(blocks[..., 2:]) ^ np.uint8(0x80)
        return (values.reshape(rows, -1).view(np.uint32), d,
                (d * np.float16(-128)).astype(np.float16))
    qs = blocks[..., 4:] if name == "Q4_1" else blocks[..., 2:]
    values = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (rows, groups, 32)
    packed = values[..., 0::2] | (values[..., 1::2] << 4)
    weight = np.ascontiguousarray(packed).reshape(rows, -1).view(np.uint32)
    if name == "Q4_1":
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
        return weight, d, m
    return weight, d, (d * np.float16(-8)).astype(np.float16)
