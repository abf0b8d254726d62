"""The native decode step's C library (decode_step.c): built on first use, its structs.

engine/decode/native_decode.py fills one ``Layer`` per layer of a model and calls the library's
four functions a layer between its collectives (engine/decode/native_batched.py its batched
forms, batch_step.h) (on a pool of threads the library starts
once, ``spmd_cp_decode_set_threads``); this module only builds and loads the library
(runtime/native.py, like the sgemv forward), declares the functions' argument types, and
mirrors decode_step.c's ``matrix`` and ``layer`` structs. The library resolves
``cblas_sgemm`` in the process's global scope (the forward or the BLAS that the re-exec
preloads, blas/reexec.py); where there is none it is not used. Standard library only.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

SOURCE = Path(__file__).with_name("decode_step.c")
NAME = "spmd-cp-decode-step"  # the built file: <cache>/kernels/<NAME>-<source hash>.so
MAX_PIECES = 3  # decode_step.c's: q/k/v rows of at most three matrices a rank
MAX_GROUP = 64  # query heads a KV head, at most (the C side's stack arrays)
MAX_HEAD_DIM = 512  # kv_half.h's: a half-precision cache row widened on the stack
# kv_half.h's element kinds of the cache, by MLX dtype name
KV_KINDS = {"float32": 0, "float16": 1, "bfloat16": 2}
# decode_step.c's MLP activations, by mlx-lm's name of the gate's
ACTIVATIONS = {"silu": 0, "gelu_approx": 1}


class Matrix(ctypes.Structure):
    """decode_step.c's ``matrix``: a weight (rows x cols, rows ld floats apart)."""

    _fields_ = [("weights", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("rows", ctypes.c_int), ("cols", ctypes.c_int), ("ld", ctypes.c_int)]


class Layer(ctypes.Structure):
    """decode_step.c's ``layer``: one rank's part of one layer."""

    _fields_ = [("dim", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("qk_eps", ctypes.c_float),
                ("qkv_pieces", ctypes.c_int), ("qkv", Matrix * MAX_PIECES),
                ("o", Matrix),
                ("gate", Matrix), ("up", Matrix), ("down", Matrix),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("capacity", ctypes.c_int), ("scale", ctypes.c_float),
                ("kv_kind", ctypes.c_int), ("activation", ctypes.c_int),
                ("attention_out_norm", ctypes.c_void_p), ("mlp_out_norm", ctypes.c_void_p),
                ("attention_out_eps", ctypes.c_float), ("mlp_out_eps", ctypes.c_float)]


class BatchAttention(ctypes.Structure):
    """batch_step.h's ``batch_attention``: what a batched step's attention reads besides
    the layer (per-row arrays as addresses)."""

    _fields_ = [("rows", ctypes.c_int), ("rotations", ctypes.c_void_p),
                ("stores", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("firsts", ctypes.c_void_p), ("length", ctypes.c_int),
                ("tail_keys", ctypes.c_void_p), ("tail_values", ctypes.c_void_p),
                ("tail_capacity", ctypes.c_int), ("tail_firsts", ctypes.c_void_p),
                ("tail_lengths", ctypes.c_void_p)]


STRUCTS = {"matrix": Matrix, "layer": Layer, "batch_attention": BatchAttention}


def layout_mismatch(loaded) -> str:
    """"" where every ctypes struct above has decode_step.c's size and field offsets
    (the library reports them, spmd_cp_decode_layout), else the first difference: a
    struct changed on one side only would hand the kernels wrong pointers."""
    loaded.spmd_cp_decode_layout.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    loaded.spmd_cp_decode_layout.restype = ctypes.c_long
    for name, struct in STRUCTS.items():
        fields = [("", ctypes.sizeof(struct))]
        fields += [(field, getattr(struct, field).offset) for field, _ in struct._fields_]
        for field, offset in fields:
            in_c = loaded.spmd_cp_decode_layout(name.encode(), field.encode())
            if in_c != offset:
                what = f"{name}.{field}'s offset" if field else f"sizeof({name})"
                return (f"decode_step.c and decode_step.py disagree: {what} is {in_c} "
                        f"in C, {offset} in ctypes")
    return ""


@functools.lru_cache(maxsize=1)
def library():
    """(the loaded library, "") or (None, why not)."""
    from ..runtime import native

    try:
        path = native.build(SOURCE, native.built_path(SOURCE, "kernels", NAME))
        loaded = ctypes.CDLL(str(path))
    except (RuntimeError, OSError) as error:
        return None, str(error)
    mismatch = layout_mismatch(loaded)
    if mismatch:
        return None, mismatch
    if not loaded.spmd_cp_decode_ready():
        return None, "no cblas_sgemm in the process's global scope"
    pointer, integer, real = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    loaded.spmd_cp_decode_set_threads.argtypes = [integer]
    loaded.spmd_cp_decode_set_threads.restype = integer
    loaded.spmd_cp_decode_scratch.argtypes = [integer] * 3
    loaded.spmd_cp_decode_scratch.restype = ctypes.c_long
    signatures = {
        "spmd_cp_decode_qkv": [pointer] * 5,
        "spmd_cp_decode_attend": [pointer, pointer, pointer, integer, integer, integer,
                                  integer, pointer, pointer],
        "spmd_cp_decode_merge": [integer, integer, integer, real, pointer, pointer],
        "spmd_cp_decode_output": [pointer] * 3,
        "spmd_cp_decode_norm": [pointer, real, integer, pointer],
        "spmd_cp_decode_activation": [integer, pointer, pointer, ctypes.c_long, pointer],
        "spmd_cp_decode_mlp": [pointer] * 5,
        "spmd_cp_decode_head": [pointer, integer, pointer, pointer, pointer, real, pointer,
                                pointer],
    }
    signatures.update({  # batch_step.h's (engine/decode/native_batched.py)
        "spmd_cp_batch_qkv": [pointer, integer, pointer, pointer, pointer, pointer],
        "spmd_cp_batch_attend": [pointer] * 5,
        "spmd_cp_batch_merge": [integer, integer, integer, real, pointer, ctypes.c_long,
                                pointer],
        "spmd_cp_batch_output": [pointer, integer, pointer, pointer],
        "spmd_cp_batch_mlp": [pointer, integer, pointer, pointer, pointer, pointer],
        "spmd_cp_batch_final_norm": [integer, integer, pointer, pointer, pointer, real,
                                     pointer],
        "spmd_cp_batch_product": [pointer, integer, pointer, pointer, integer],
    })
    loaded.spmd_cp_batch_scratch.argtypes = [integer] * 6
    loaded.spmd_cp_batch_scratch.restype = ctypes.c_long
    for name, argtypes in signatures.items():
        function = getattr(loaded, name)
        function.argtypes, function.restype = argtypes, None
    loaded.spmd_cp_prefill_attend.argtypes = [pointer] * 5 + [integer] * 5 + [
        ctypes.c_int64, real, ctypes.c_int64, pointer, pointer]
    loaded.spmd_cp_prefill_attend.restype = integer
    return loaded, ""
