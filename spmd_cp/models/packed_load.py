"""A GGUF file loaded with its quantized matrices kept packed: the file's bytes are the
only copy of those weights.

Each 2-D quantized matrix becomes two things: its packed form (the file's own blocks,
memory-mapped: ``quantized_shadows.BLOCK_TYPES``) and a float32 array of its shape whose
memory is released as soon as it is registered (quantized_shadows.Shadows.release). The
float32 array is the matrix's name in the model: mlx-lm's modules multiply by it as
ever, and the preloaded BLAS forward (kernels/gemv_forward.c) reads the packed form
instead, a decode row in registers, a prefill tile at a time into float32 for the BLAS.
An embedding's lookup reads its rows from the packed form too
(quantized_shadows.embedding_rows).

Registration checks the kernel's dequantization against the reference on the first
``CHECKED_ROWS`` rows of every matrix (the gguf package's dequantizer; the test suite
checks every row of every type). Everything else (norms, F16 / BF16 / F32 matrices, a
mixture's stacked experts) is float32 as before, as is a matrix the kernels refuse.

The embedding's float32 name is made first, before the packed forms and the tokenizer
are read: making it writes its pages once (MLX has no way to allocate without), and
that transient then sets the process's resident peak as little as it can.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..runtime.resident import note_mapped_weights
from . import gguf_types
from .gguf import _ready, _skeleton, dequantize_float32, header_config
from .quantized_shadows import BLOCK_TYPES, SHADOWS, Blocks, Packed, release_pages

CHECKED_ROWS = 8  # rows of each matrix checked bit for bit against the reference at load
EMBEDDING = "model.embed_tokens.weight"


def load_gguf_packed(path: str) -> tuple[nn.Module, object, dict]:
    """(mlx-lm model, tokenizer, config) of a GGUF file, its quantized matrices packed."""
    from .tensor_files import GGUFFile

    files = GGUFFile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")  # pages shared by a host's ranks
    note_mapped_weights(path)  # counted as weights, not again as the process's own
    SHADOWS.releasing = True
    order = sorted(files.names, key=lambda name: name != EMBEDDING)  # the largest first
    weights = {}
    for name in order:
        weights.update(_tensor(files, mapped, name))
    config, tokenizer = header_config(files)
    model = _skeleton(config, "output.weight" in files.infos)
    model.load_weights(list(weights.items()), strict=True)
    return _ready(model), tokenizer, config


def _tensor(files, mapped: np.memmap, name: str) -> dict:
    """{mlx-lm name: array} of one tensor: a packed matrix's released float32 name, or
    the tensor in the form the float32 load gives."""
    info = files.infos[files.names[name]]
    if len(info.shape) == 2 and gguf_types.name_of(info.kind) in BLOCK_TYPES:
        key = _released_name(info.shape)  # before the packed bytes
        rows, cols = info.shape
        row_bytes = gguf_types.byte_shape(info.shape, info.kind)[-1]
        data = mapped[info.offset:info.offset + rows * row_bytes].reshape(rows, row_bytes)
        blocks = Blocks(data, info.kind, cols)
        return {name: _registered(key, blocks, _first_rows(blocks),
                                  lambda: mx.array(gguf_types.to_float32(
                                      np.asarray(data), info.kind, info.shape)))}
    part = files.read(name)
    base = name[: -len(".weight")]
    if f"{base}.scales" not in part:
        mx.eval(part[name])
        return part
    # a mixture's stacked Q4_0 / Q4_1 / Q8_0 experts: float32, as decode reads them
    weight = dequantize_float32(part[name], part[f"{base}.scales"], part[f"{base}.biases"],
                                gguf_types.affine_bits(info.kind))
    mx.eval(weight)
    return {name: weight}


def released_columns(source: mx.array, start: int, stop: int) -> mx.array | None:
    """Inputs [start, stop) of a packed-only matrix as a float32 name of their own,
    registered with the same columns of the packed form (a view) and released: no float32
    values are made or copied (the split decode step's columns of down, which filling
    the whole matrix to copy them took 12 s of for an 8B model's 32 layers at N = 2).
    None where ``source`` holds its values (not packed-only) or the cut falls inside a
    block or group: the caller copies the columns."""
    packed = SHADOWS.packed_of(source) if SHADOWS.is_released(source) else None
    packed = packed.columns(start, stop) if packed is not None else None
    if packed is None:
        return None
    name = _released_name((source.shape[0], stop - start))
    if not SHADOWS.register(name, packed, check=_first_rows(packed)):
        return None
    if not SHADOWS.is_released(name):  # its memory holds no values: products read packed
        SHADOWS.release(name)
    return name


def _first_rows(packed: Packed | Blocks) -> np.ndarray:
    """The first ``CHECKED_ROWS`` rows of a packed form in float32 by the reference (the
    gguf package's dequantizer for blocks, float32 arithmetic for an affine triple)."""
    if isinstance(packed, Blocks):
        rows = min(CHECKED_ROWS, packed.data.shape[0])
        raw = np.ascontiguousarray(packed.data[:rows])
        return gguf_types.to_float32(raw, packed.kind, (rows, packed.cols))
    return np.array(packed.rows(0, min(CHECKED_ROWS, packed.weight.shape[0])).dequantized())


def _released_name(shape: tuple) -> mx.array:
    """A float32 array of ``shape`` whose memory is handed back at once (MLX writes it
    when it makes it): the name of a packed matrix."""
    name = mx.zeros(shape, mx.float32)
    mx.eval(name)
    release_pages(name)
    return name


def _registered(name: mx.array, packed: Packed | Blocks, check: np.ndarray,
                dequantized) -> mx.array:
    """``name`` registered as the packed matrix's (and released); where the kernels
    refuse it, the matrix in float32 (``dequantized()``)."""
    if SHADOWS.register(name, packed, check=np.ascontiguousarray(check, np.float32)):
        SHADOWS.nbytes += packed.nbytes
        return name
    del name
    weight = dequantized()
    mx.eval(weight)
    return weight
