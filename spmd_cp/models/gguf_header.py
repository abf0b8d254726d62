"""A GGUF file's header read with the standard library alone: the metadata `spmd-cp doctor`
needs, and the check that every tensor lies inside the file, without loading (or importing
MLX for) the weights.

Every length read from the file is checked against the bytes that remain before it is
used, so a truncated download or a text file named .gguf gives one ValueError saying
what is wrong, never a huge allocation or a crash inside the weight loader.

The block sizes of the tensor types are the gguf package's (llama.cpp's own reader and
writer). Its ``GGUFReader`` is not used for the header: it makes numpy views of every
element of the vocabulary arrays, 9.3 s for Gemma 3's 262,144 tokens where this reader
takes 0.3 s (2.6 s against 0.14 s for the embedded SmolLM2), on every rank of every run.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # of the tensor data, unless `general.alignment` says otherwise



@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    ggml_type: int
    offset: int  # from the start of the tensor data

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensor (ValueError for a type or shape GGML cannot store)."""
        from .gguf_types import block_of, name_of  # the gguf package's table

        try:
            block_values, block_bytes = block_of(self.ggml_type)
        except ValueError:
            raise ValueError(f"tensor {self.name!r} has unknown GGML type {self.ggml_type}")
        if self.shape and self.shape[0] % block_values:
            raise ValueError(f"tensor {self.name!r}: {name_of(self.ggml_type)} rows of "
                             f"{self.shape[0]} values are not whole blocks of {block_values}")
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
    unknown type or one extending past the end (an incomplete download). The last file's
    answer is kept: the check before loading and the loader read the same header.
    """
    stat = os.stat(path)
    return _layout(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def forget_layouts():
    """Drop the kept header (its vocabulary is megabytes of Python strings) once loaded."""
    _layout.cache_clear()


@functools.lru_cache(maxsize=1)
def _layout(path: str, _size: int, _mtime_ns: int) -> tuple[dict, list[TensorInfo], int]:
    with _map(path) as buffer:
        meta, infos, data_start = _parse(buffer)
        size = len(buffer)
    for info in infos:
        end = data_start + info.offset + info.nbytes
        if end > size:
            from .gguf_types import name_of

            type_name = name_of(info.ggml_type)
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
