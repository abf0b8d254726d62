"""A GGUF file's header read with the standard library alone: the metadata `spmd-cp doctor`
needs, and the check that every tensor lies inside the file, without loading (or importing
MLX for) the weights.

Every length read from the file is checked against the bytes that remain before it is
used, so a truncated download or a text file named .gguf gives one ValueError saying
what is wrong, never a huge allocation or a crash inside the weight loader.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # of the tensor data, unless `general.alignment` says otherwise

# GGML tensor types: (name, bytes per block, values per block), from ggml.h / ggml.c.
GGML_TYPES = {
    0: ("F32", 4, 1), 1: ("F16", 2, 1), 2: ("Q4_0", 18, 32), 3: ("Q4_1", 20, 32),
    6: ("Q5_0", 22, 32), 7: ("Q5_1", 24, 32), 8: ("Q8_0", 34, 32), 9: ("Q8_1", 36, 32),
    10: ("Q2_K", 84, 256), 11: ("Q3_K", 110, 256), 12: ("Q4_K", 144, 256),
    13: ("Q5_K", 176, 256), 14: ("Q6_K", 210, 256), 15: ("Q8_K", 292, 256),
    16: ("IQ2_XXS", 66, 256), 17: ("IQ2_XS", 74, 256), 18: ("IQ3_XXS", 98, 256),
    19: ("IQ1_S", 50, 256), 20: ("IQ4_NL", 18, 32), 21: ("IQ3_S", 110, 256),
    22: ("IQ2_S", 82, 256), 23: ("IQ4_XS", 136, 256), 24: ("I8", 1, 1), 25: ("I16", 2, 1),
    26: ("I32", 4, 1), 27: ("I64", 8, 1), 28: ("F64", 8, 1), 29: ("IQ1_M", 56, 256),
    30: ("BF16", 2, 1),
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    ggml_type: int
    offset: int  # from the start of the tensor data

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensor (ValueError for a type or shape GGML cannot store)."""
        if self.ggml_type not in GGML_TYPES:
            raise ValueError(f"tensor {self.name!r} has unknown GGML type {self.ggml_type}")
        type_name, block_bytes, block_values = GGML_TYPES[self.ggml_type]
        if self.shape and self.shape[0] % block_values:
            raise ValueError(f"tensor {self.name!r}: {type_name} rows of {self.shape[0]} "
                             f"values are not whole blocks of {block_values}")
        count = 1
        for dim in self.shape:
            count *= dim
        return count // block_values * block_bytes


class _Reader:
    """Little-endian values from a buffer, each bounded by the bytes that remain."""

    def __init__(self, buffer):
        self.buffer, self.pos = buffer, 0

    def take(self, size: int, what: str) -> int:
        if size > len(self.buffer) - self.pos:
            raise ValueError(f"truncated: {what} at byte {self.pos} needs {size} bytes, the "
                             f"file ends at byte {len(self.buffer)}")
        start, self.pos = self.pos, self.pos + size
        return start

    def unpack(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.buffer, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        size = self.unpack("<Q", what)
        start = self.take(size, what)
        return bytes(self.buffer[start:start + size]).decode("utf-8", errors="replace")

    def value(self, kind: int, key: str):
        if kind in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[kind], f"metadata value {key!r}")
        if kind == _GGUF_STRING:
            return self.string(f"metadata value {key!r}")
        if kind == _GGUF_ARRAY:
            item_kind, count = self.unpack("<I", key), self.unpack("<Q", key)
            if item_kind in _GGUF_SCALARS:  # numbers: read them (head counts per layer)
                fmt = _GGUF_SCALARS[item_kind]
                start = self.take(count * struct.calcsize(fmt), f"metadata array {key!r}")
                return list(struct.unpack_from(f"<{count}{fmt[1]}", self.buffer, start))
            return [self.value(item_kind, key) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {kind} in metadata {key!r}")


def _parse(buffer, stop_when=None, tensors: bool = True):
    """(metadata, tensor infos, offset of the tensor data) of a GGUF v2/v3 image."""
    reader = _Reader(buffer)
    if len(buffer) < 4 or bytes(buffer[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (it does not start with the bytes 'GGUF')")
    reader.pos = 4
    version = reader.unpack("<I", "version")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
    tensor_count, kv_count = reader.unpack("<Q", "tensor count"), reader.unpack("<Q", "key count")
    meta = {}
    for _ in range(kv_count):
        key = reader.string("metadata key")
        meta[key] = reader.value(reader.unpack("<I", f"type of {key!r}"), key)
        if stop_when is not None and stop_when(meta):
            return meta, [], None
    infos = []
    for _ in range(tensor_count if tensors else 0):
        name = reader.string("tensor name")
        dims = reader.unpack("<I", f"tensor {name!r}")
        shape = tuple(reader.unpack("<Q", f"tensor {name!r}") for _ in range(dims))
        ggml_type, offset = reader.unpack("<I", name), reader.unpack("<Q", name)
        infos.append(TensorInfo(name, shape, ggml_type, offset))
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT) or DEFAULT_ALIGNMENT
    return meta, infos, -(-reader.pos // alignment) * alignment


def _map(path: str):
    """The file's bytes, mapped (the header of a large file is read without copying it)."""
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            raise ValueError("empty file")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_gguf_metadata(path: str, stop_when=None) -> dict:
    """The key/value metadata of a GGUF (v2/v3) file, read from its header only.

    Args:
        stop_when: optional predicate on the dict read so far; reading stops once it holds
            (the tokenizer's vocabulary arrays come last and are large).
    """
    with _map(path) as buffer:
        return _parse(buffer, stop_when, tensors=False)[0]


def read_gguf_tensors(path: str) -> tuple[dict, list[TensorInfo]]:
    """(metadata, tensor infos) of a GGUF file whose every tensor lies inside the file
    (see ``read_gguf_layout``)."""
    meta, infos, _ = read_gguf_layout(path)
    return meta, infos


def read_gguf_layout(path: str) -> tuple[dict, list[TensorInfo], int]:
    """(metadata, tensor infos, byte offset of the tensor data) of a GGUF file whose every
    tensor lies inside the file.

    Raises ValueError naming what is wrong: not GGUF, a header cut short, a tensor of an
    unknown type or one extending past the end (an incomplete download).
    """
    with _map(path) as buffer:
        meta, infos, data_start = _parse(buffer)
        size = len(buffer)
    for info in infos:
        end = data_start + info.offset + info.nbytes
        if end > size:
            type_name = GGML_TYPES[info.ggml_type][0]
            raise ValueError(f"truncated: tensor {info.name!r} ({type_name}, "
                             f"{'x'.join(map(str, info.shape))}) ends at byte {end}, the file "
                             f"ends at byte {size} (incomplete download?)")
    return meta, infos, data_start


def head_counts(path: str) -> tuple[int, int]:
    """(query heads NH, KV heads NKV) of a model, from config.json or the GGUF header."""
    p = Path(path)
    if p.is_dir():
        config = json.loads((p / "config.json").read_text())
        config = config.get("text_config") or config  # a multimodal checkpoint's text model
        heads = config["num_attention_heads"]
        return heads, config.get("num_key_value_heads") or heads

    def found(meta):
        arch = meta.get("general.architecture")
        return arch is not None and all(f"{arch}.attention.head_count{s}" in meta
                                        for s in ("", "_kv"))

    meta = read_gguf_metadata(path, stop_when=found)
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    def widest(count):  # some architectures list counts per layer: the widest sets traffic
        return max(count) if isinstance(count, list) else count

    return widest(heads), widest(kv_heads) or widest(heads)
