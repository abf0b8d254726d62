"""Whether a decode step can run natively (native_decode.py) on this rank: the flags, the
compute path, the model's modules and dtypes, the C library. Checked before any rank
commits to the native step, so every rank can take the same way (decode_plan.py); the
part the settings alone decide is checked again before any model loads, so that
``--decode-step native`` where it cannot run fails before the heavy work (run/builder.py)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ...blas.libraries import rank_threads
from ...config import DecodeConfig
from ...kernels import decode_step
from ...kernels.decode_step import KV_KINDS, MAX_GROUP, MAX_HEAD_DIM
from ...runtime.device import Compute
from ..layer_parts import LayerParts, describe_feed_forward, head_counts
from ..model import CPModel
from .one_token import EXACT_AS_MATRIX

def availability(compute: Compute) -> str:
    """One line for doctor: whether decode steps can run natively on this rank (each
    model is checked when it runs: float32 or half-precision-cache Llama/Qwen/Phi-3/Gemma 3
    layers; ``--decode-step graph`` turns it off)."""
    if compute.gpu:
        return "not used (the GPU path runs MLX's step)"
    library, why = decode_step.library()
    if library is None:
        return f"not available ({why})"
    return (f"on (decode steps as C calls between MPI collectives, {rank_threads()} "
            f"thread(s) a rank; a float32, float16 or bfloat16 KV cache)")


def _described(module) -> str:
    """'a QuantizedLinear of uint32': a module's class and its weight's dtype."""
    dtype = str(module["weight"].dtype).removeprefix("mlx.core.")
    return f"a {type(module).__name__} of {dtype}"


def flag_obstacle(config: DecodeConfig) -> str | None:
    """The decode flags that rule the native step out, or None."""
    if config.decode_step == "graph":
        return "--decode-step graph"
    if config.decode_comm == "mlx":  # the native step's collectives are MPI requests
        return "--decode-comm mlx"
    return None


def settings_obstacle(compute: Compute, kv_dtype: str, sharded: bool) -> str | None:
    """What a run's settings alone rule out, or None: the path, the KV cache's dtype
    (``kv_dtype``: its name), layer-sharded weights."""
    if compute.gpu:
        return "the GPU path"
    if kv_dtype not in KV_KINDS:
        return f"the KV cache is {kv_dtype}"
    if sharded:
        return "layer-sharded weights"
    return None


def library_obstacle() -> str | None:
    """Why the C library cannot be had on this rank (built on first use), or None."""
    library, why = decode_step.library()
    return None if library is not None else why


def upfront_obstacle(config: DecodeConfig, compute: Compute, kv_dtype: str,
                     sharded: bool) -> str | None:
    """Why the native step cannot run on this rank, from the settings alone, before any
    model loads: the flags, ``settings_obstacle``, the C library. The model's own
    obstacles wait for its modules (``native_obstacle``)."""
    return (flag_obstacle(config) or settings_obstacle(compute, kv_dtype, sharded)
            or library_obstacle())


def native_obstacle(model: CPModel) -> str | None:
    """Why decode steps of ``model`` cannot run on this rank, or None: the path, the
    modules and their dtypes, the C library (the split step's slices are checked as
    ``NativeDecoder`` is built)."""
    if model.tensor_group is not None:
        return "the weights are cut into tensor-parallel slices (--tp), MLX's step sums them"
    if model.ffn_client is not None:
        return "the MLPs run on the FFN ranks (--afd)"
    kv_dtype = str(model.kv_dtype).removeprefix("mlx.core.")
    reason = settings_obstacle(model.compute, kv_dtype, getattr(model.layers, "sharded", False))
    return reason or modules_obstacle(model.embed_tokens, model.layers, model.lm_head) \
        or library_obstacle()


def loaded_obstacle(model: nn.Module, compute: Compute) -> str | None:
    """``native_obstacle`` of an mlx-lm model as loaded (whole layers on every rank, a
    KV dtype the native step reads), before any CPModel wraps it: the KV dtype's choice
    asks it (decode_plan.choose_kv_dtype)."""
    inner = model.model
    head = getattr(model, "lm_head", None)
    return (settings_obstacle(compute, "float32", getattr(inner.layers, "sharded", False))
            or modules_obstacle(inner.embed_tokens, inner.layers,
                                head if head is not None else inner.embed_tokens)
            or library_obstacle())


def modules_obstacle(embedding, layers, lm_head) -> str | None:
    """What in the model's own modules the native step does not compute, or None: the
    embedding, the head counts and widths, each layer's MLP, RoPE and matrices, the LM
    head (a tied head: the embedding, or its ``as_linear``)."""
    if type(embedding) is not nn.Embedding or embedding["weight"].dtype != mx.float32:
        return f"the embedding is {_described(embedding)}"
    heads, kv_heads = head_counts(layers[0].self_attn)
    if heads % kv_heads or heads // kv_heads > MAX_GROUP:
        return f"{heads} query heads over {kv_heads} KV heads"
    head_dim = LayerParts.of(layers[0]).qkv_widths[1] // kv_heads  # k's width
    if head_dim > MAX_HEAD_DIM:
        return f"heads of {head_dim} dimensions (at most {MAX_HEAD_DIM})"
    for index, layer in enumerate(layers):
        parts = LayerParts.of(layer)
        if not parts.is_dense:
            return (f"layer {index}: its MLP is {describe_feed_forward(parts.feed_forward)}, "
                    "which the native step does not compute")
        if type(layer.self_attn.rope) not in EXACT_AS_MATRIX:
            return f"layer {index}: its RoPE is a {type(layer.self_attn.rope).__name__}"
        for name, module in parts.named():
            if type(module) is not nn.Linear or module["weight"].dtype != mx.float32:
                return f"layer {index}: {name} is {_described(module)}"
    head = getattr(lm_head, "__self__", lm_head)  # tied: the embedding
    if type(head) not in (nn.Linear, nn.Embedding) or head["weight"].dtype != mx.float32:
        return f"the LM head is {_described(head)}"
    return None
