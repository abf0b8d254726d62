"""Read chosen tensors, or chosen rows of them, from model files without reading the rest.

A rank of a sharded run (engine/weights/weights.py) holds only its own layers and its slice of
the vocabulary, so it must never load the whole file, not even transiently: these
readers find each tensor's byte range in the file's header and read only that range.

Both present tensors under mlx-lm's parameter names in the form a rank holds them
("packed"): a GGUF Q4_0 / Q4_1 / Q8_0 tensor becomes the MLX affine triple (weight,
scales, biases; group size 32) bit for bit as ``mx.load`` makes it, every other GGUF
type float32 (gguf_types.py: the gguf package's dequantizer, rows of a block-quantized
matrix cut on block boundaries); safetensors come as stored.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import gguf_types
from .gguf import _CONFIG_TENSORS, GROUP_SIZE, _mlx_name, norm_shift
from .gguf_config import model_type_of
from .gguf_header import read_gguf_layout

# safetensors dtype -> (numpy dtype read from the file, MLX dtype it stands for)
_SAFETENSORS_DTYPES = {
    "F32": (np.float32, mx.float32), "F16": (np.float16, mx.float16),
    "BF16": (np.uint16, mx.bfloat16), "U32": (np.uint32, mx.uint32),
    "I32": (np.int32, mx.int32), "I64": (np.int64, mx.int64), "U8": (np.uint8, mx.uint8),
    "I8": (np.int8, mx.int8),
}  # fmt: skip

GGML_F32 = 0


def _read(path: str, offset: int, count: int, dtype) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(offset)
        data = np.fromfile(f, dtype=dtype, count=count)
    if data.size != count:
        raise ValueError(f"{path}: truncated tensor data")
    return data


def _rows(shape: tuple, rows) -> tuple[int, int]:
    return (0, shape[0] if shape else 1) if rows is None else rows


class SafetensorsFiles:
    """Every ``*.safetensors`` file of an MLX / Hugging Face model directory."""

    def __init__(self, directory: str):
        self.entries = {}  # name -> (file, numpy dtype, MLX dtype, shape, data offset)
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise ValueError(f"no *.safetensors files in {directory}")
        for path in files:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] not in _SAFETENSORS_DTYPES:
                    raise ValueError(f"{path}: tensor {name} has unsupported dtype "
                                     f"{entry['dtype']}")
                np_dtype, mx_dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
                self.entries[name] = (path, np_dtype, mx_dtype, tuple(entry["shape"]),
                                      8 + length + entry["data_offsets"][0])

    def specs(self) -> dict:
        """{name: (shape, MLX dtype)} of every tensor, from the headers alone."""
        return {name: (e[3], e[2]) for name, e in self.entries.items()}

    def block_shadows(self) -> dict:
        """No GGUF blocks here (MLX's quantized triples count through ``specs``)."""
        return {}

    def read(self, name: str, rows=None) -> dict:
        """{name: array}: the tensor, or rows [a, b) of its first axis."""
        path, np_dtype, mx_dtype, shape, offset = self.entries[name]
        a, b = _rows(shape, rows)
        row = math.prod(shape[1:])
        data = _read(path, offset + a * row * np.dtype(np_dtype).itemsize, (b - a) * row,
                     np_dtype)
        array = mx.array(data.reshape((b - a,) + shape[1:] if shape else ()))
        return {name: array.view(mx_dtype) if mx_dtype == mx.bfloat16 else array}


class GGUFFile:
    """A GGUF file's tensors under mlx-lm names, quantized ones as MLX triples."""

    def __init__(self, path: str):
        self.path = path
        self.metadata, infos, data_start = read_gguf_layout(path)
        # shape in numpy order (GGUF lists the fastest dimension first); absolute offsets
        self.infos = {i.name: _Tensor(tuple(reversed(i.shape)), i.ggml_type,
                                      data_start + i.offset) for i in infos}
        self.model_type = model_type_of(self.metadata.get("general.architecture"), self.infos)
        # mlx-lm -> GGUF name (not the tensors that are configuration)
        self.names = {_mlx_name(name, self.model_type): name for name in self.infos
                      if _mlx_name(name, self.model_type) is not None}

    def header_tensors(self) -> dict:
        """{GGUF name: tensor info} with the tensors that are configuration (Phi-3's RoPE
        factors) read: what gguf.gguf_config needs of the tensors."""
        tensors = dict(self.infos)
        for name in _CONFIG_TENSORS:
            info = self.infos.get(name)
            if info is not None and info.kind == GGML_F32:
                tensors[name] = mx.array(_read(self.path, info.offset, math.prod(info.shape),
                                               np.float32))
        return tensors

    def specs(self) -> dict:
        """{mlx-lm name: (shape, MLX dtype)} of every tensor in the form ``read`` gives."""
        specs = {}
        for name, gguf_name in self.names.items():
            info = self.infos[gguf_name]
            if gguf_types.is_affine(info.kind):
                *rows, cols = info.shape  # rows: (experts, out) for a mixture's experts
                bits = gguf_types.affine_bits(info.kind)
                base = name[: -len(".weight")]
                specs[name] = ((*rows, cols * bits // 32), mx.uint32)
                specs[f"{base}.scales"] = ((*rows, cols // GROUP_SIZE), mx.float16)
                specs[f"{base}.biases"] = ((*rows, cols // GROUP_SIZE), mx.float16)
            else:
                specs[name] = (info.shape, mx.float32)
        return specs

    def block_shadows(self) -> dict:
        """{mlx-lm name: bytes} of the matrices decode reads as the file's own blocks (the
        2-D tensors of a type in quantized_shadows.BLOCK_TYPES: gguf.packed_weights;
        Q4_0 / Q4_1 / Q8_0 ones among them, though ``specs`` gives their MLX triples)."""
        from .quantized_shadows import BLOCK_TYPES

        return {name: math.prod(gguf_types.byte_shape(info.shape, info.kind))
                for name, info in ((n, self.infos[g]) for n, g in self.names.items())
                if gguf_types.name_of(info.kind) in BLOCK_TYPES and len(info.shape) == 2}

    def read(self, name: str, rows=None) -> dict:
        """{name: array} (a triple for a Q4_0 / Q4_1 / Q8_0 weight): the tensor or rows
        [a, b) of its first axis (whole rows: a block never spans two)."""
        info = self.infos[self.names[name]]
        a, b = _rows(info.shape, rows)
        shape = (b - a, *info.shape[1:]) if info.shape else ()
        values, size = gguf_types.block_of(info.kind)
        row = math.prod(info.shape[1:])  # values a row, a multiple of the block (or 1)
        raw = _read(self.path, info.offset + a * row // values * size,
                    (b - a) * row // values * size, np.uint8)
        if not gguf_types.is_affine(info.kind):
            array = mx.array(gguf_types.to_float32(raw, info.kind, shape))
            shift = norm_shift(self.names[name], self.model_type)  # as gguf.convert_weights
            return {name: array - shift if shift else array}
        cols = info.shape[-1]
        triple = gguf_types.unpack_rows(raw.reshape(-1, cols // values, size), info.kind)
        weight, scales, biases = (mx.array(t.reshape(*shape[:-1], -1)) for t in triple)
        base = name[: -len(".weight")]
        return {name: weight, f"{base}.scales": scales, f"{base}.biases": biases}


@dataclass(frozen=True)
class _Tensor:
    shape: tuple  # numpy order
    kind: int  # GGML type
    offset: int  # absolute, in the file


def open_tensor_files(path: str):
    """The reader for a GGUF file or an MLX / HF model directory."""
    return GGUFFile(path) if os.path.isfile(path) else SafetensorsFiles(path)
