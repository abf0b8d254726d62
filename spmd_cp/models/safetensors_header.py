"""The check that a .safetensors file is whole, read from its header with the standard library.

Layout: an 8-byte little-endian header length H, H bytes of JSON naming each tensor's
dtype, shape and ``data_offsets`` [begin, end) (relative to byte 8 + H), then the data.
"""

from __future__ import annotations

import json
import os
import struct

# A larger header is not a safetensors file (the format itself caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


def check_safetensors(path: str):
    """Raise ValueError saying what is wrong unless every tensor lies inside the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"truncated: {size} bytes, not even a safetensors header")
        header_bytes = struct.unpack("<Q", head)[0]
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"not a whole safetensors file (header of {header_bytes} bytes "
                             f"in a file of {size})")
        try:
            header = json.loads(f.read(header_bytes))
        except (UnicodeDecodeError, ValueError):
            raise ValueError("not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file (its header is not a JSON object)")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"tensor {name!r} has no data_offsets in the header") from None
        if 8 + header_bytes + end > size:
            raise ValueError(f"truncated: tensor {name!r} ends at byte {8 + header_bytes + end}, "
                             f"the file ends at byte {size} (incomplete download?)")
