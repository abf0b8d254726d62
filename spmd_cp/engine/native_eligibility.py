"""Whether a decode step can run natively (native_decode.py) on this rank: the compute
path, the model's modules and dtypes, the C library. Checked before any rank commits to
the native step, so every rank can take the same way (decode_plan.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kernels import decode_step
from ..kernels.decode_step import MAX_GROUP
from ..runtime.device import on_gpu_path
from .model import SWIGLU_MLPS, CPModel
from .one_token import EXACT_AS_MATRIX


def availability() -> str:
    """One line for doctor: whether decode steps can run natively on this rank (each
    model is checked when it runs: float32 Llama/Qwen layers; ``--decode-step graph``
    turns it off)."""
    if on_gpu_path():
        return "not used (the GPU path runs MLX's step)"
    library, why = decode_step.library()
    if library is None:
        return f"not available ({why})"
    return "on (decode steps as C calls between MPI collectives)"


def _described(module) -> str:
    """'a QuantizedLinear of uint32': a module's class and its weight's dtype."""
    dtype = str(module["weight"].dtype).removeprefix("mlx.core.")
    return f"a {type(module).__name__} of {dtype}"


def native_obstacle(model: CPModel) -> str | None:
    """Why decode steps of ``model`` cannot run on this rank, or None: the path, the
    modules and their dtypes, the C library (the split step's slices are checked as
    ``NativeDecoder`` is built)."""
    if on_gpu_path():
        return "the GPU path"
    if model.kv_dtype != mx.float32:
        return "the KV cache is not float32"
    if getattr(model.layers, "sharded", False):
        return "layer-sharded weights"
    embedding = model.embed_tokens
    if type(embedding) is not nn.Embedding or embedding["weight"].dtype != mx.float32:
        return f"the embedding is {_described(embedding)}"
    if model.num_heads % model.num_kv_heads or model.num_heads // model.num_kv_heads > MAX_GROUP:
        return f"{model.num_heads} query heads over {model.num_kv_heads} KV heads"
    for index, layer in enumerate(model.layers):
        if not isinstance(layer.mlp, SWIGLU_MLPS):
            return f"layer {index}: its MLP is not a SwiGLU gate/up/down"
        if type(layer.self_attn.rope) not in EXACT_AS_MATRIX:
            return f"layer {index}: its RoPE is a {type(layer.self_attn.rope).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        for name, module in (("q_proj", attn.q_proj), ("k_proj", attn.k_proj),
                             ("v_proj", attn.v_proj), ("o_proj", attn.o_proj),
                             ("gate_proj", mlp.gate_proj), ("up_proj", mlp.up_proj),
                             ("down_proj", mlp.down_proj)):
            if type(module) is not nn.Linear or module["weight"].dtype != mx.float32:
                return f"layer {index}: {name} is {_described(module)}"
    head = getattr(model.lm_head, "__self__", model.lm_head)  # tied: the embedding
    if type(head) not in (nn.Linear, nn.Embedding) or head["weight"].dtype != mx.float32:
        return f"the LM head is {_described(head)}"
    library, why = decode_step.library()
    return None if library is not None else why
