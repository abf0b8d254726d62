"""A GGUF file's header metadata read with the standard library alone: the head counts
`spmd-cp doctor` needs, without loading (or importing MLX for) the weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(path: str, stop_when=None) -> dict:
    """The key/value metadata of a GGUF (v2/v3) file, read from its header only.

    Args:
        stop_when: optional predicate on the dict read so far; reading stops once it holds
            (the tokenizer's vocabulary arrays come last and are large).
    """
    def unpack(fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF header")
        return struct.unpack(fmt, data)[0]

    def string():
        return f.read(unpack("<Q")).decode("utf-8", errors="replace")

    def value(kind):
        if kind in _GGUF_SCALARS:
            return unpack(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return string()
        if kind == _GGUF_ARRAY:
            item_kind, count = unpack("<I"), unpack("<Q")
            if item_kind in _GGUF_SCALARS:  # numbers: read them (head counts per layer)
                fmt = _GGUF_SCALARS[item_kind]
                return list(struct.unpack(f"<{count}{fmt[1]}",
                                          f.read(count * struct.calcsize(fmt))))
            return [value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {kind}")

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        if unpack("<I") < 2:
            raise ValueError("GGUF version 1 is not supported")
        unpack("<Q")  # tensor count
        meta = {}
        for _ in range(unpack("<Q")):
            key = string()
            meta[key] = value(unpack("<I"))
            if stop_when is not None and stop_when(meta):
                break
    return meta


def head_counts(path: str) -> tuple[int, int]:
    """(query heads NH, KV heads NKV) of a model, from config.json or the GGUF header."""
    p = Path(path)
    if p.is_dir():
        config = json.loads((p / "config.json").read_text())
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
