"""GGUF files for the tests, written and read with the gguf package (llama.cpp's own writer
and reader), and the references made from them: each tensor dequantized by
``gguf.quants.dequantize``, renamed to mlx-lm's names by a table written out here.

Block bytes are random, which is a valid block of every type, except the float16 scale
fields, which are set to finite values that keep the weights within about ``MAGNITUDE``
(random ones would be NaN, Inf or huge).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Offsets of each block type's float16 scale fields and the largest |factor| a scale is
# multiplied by (the block's integer values times its sub-scales), from ggml-common.h.
SCALE_FIELDS = {
    "Q4_0": ((0,), 8), "Q4_1": ((0, 2), 15), "Q5_0": ((0,), 16), "Q5_1": ((0, 2), 31),
    "Q8_0": ((0,), 128), "Q2_K": ((80, 82), 45), "Q3_K": ((108,), 128),
    "Q4_K": ((0, 2), 945), "Q5_K": ((0, 2), 1953), "Q6_K": ((208,), 4096),
    "IQ4_NL": ((0,), 127), "IQ4_XS": ((0,), 4064), "IQ2_XXS": ((0,), 4096),
    "TQ1_0": ((52,), 1),
}  # fmt: skip
# Weights up to about this size: a random model's attention and next-token choice far
# from uniform, so that differences show.
MAGNITUDE = 0.6


def random_tensor(kind: str, shape: tuple, rng: np.random.RandomState) -> np.ndarray:
    """Bytes of a tensor of ``shape`` (numpy order) in GGUF type ``kind`` (uint8 with its
    last axis in blocks), or float values for F32 / F16 / BF16."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    values = rng.uniform(-MAGNITUDE, MAGNITUDE, shape).astype(np.float32)
    if kind == "F32":
        return values
    if kind == "F16":
        return values.astype(np.float16)
    if kind == "BF16":
        return gguf.quants.quantize(values, qtype)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.randint(0, 256, (int(np.prod(shape)) // block_values, block_bytes),
                         dtype=np.uint8)
    offsets, factor = SCALE_FIELDS[kind]
    for offset in offsets:
        scale = rng.uniform(0.3, 1.0, len(blocks)) * MAGNITUDE / factor
        blocks[:, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(*shape[:-1], -1)


def tokenizer_metadata() -> dict:
    """The embedded SmolLM2's tokenizer keys (a byte-level BPE, its chat template), as
    plain values."""
    from spmd_cp.models.gguf import default_model_path
    from spmd_cp.models.gguf_header import read_gguf_metadata

    return {key: value for key, value in read_gguf_metadata(default_model_path()).items()
            if key.startswith("tokenizer.")}


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict) -> Path:
    """A GGUF file: ``meta`` {key: int, float, str, bool or list}, ``tensors`` {name: array
    from ``random_tensor`` (uint8 bytes of a block type, with its type) or float}."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    for name, (array, kind) in tensors.items():
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, array, raw_dtype=qtype if kind not in ("F32", "F16") else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_tensors(path: str) -> dict:
    """{GGUF name: float32 array (numpy order)}: every tensor of the file as the gguf
    package reads and dequantizes it."""
    import gguf

    reader = gguf.GGUFReader(path)
    out = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        out[tensor.name] = np.asarray(
            gguf.quants.dequantize(tensor.data, tensor.tensor_type),
            dtype=np.float32).reshape(shape)
    return out


# llama.cpp's tensor names (gguf-py's tensor_mapping.py), written out here rather than
# taken from the loader's table.
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
PER_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}  # fmt: skip
GEMMA3_PER_LAYER = {**PER_LAYER, "post_attention_norm": "post_attention_layernorm",
                    "ffn_norm": "pre_feedforward_layernorm",
                    "post_ffw_norm": "post_feedforward_layernorm"}


def mlx_lm_name(gguf_name: str, gemma3: bool = False) -> str:
    base, suffix = gguf_name.rsplit(".", 1)
    if base in TOP_LEVEL:
        return f"{TOP_LEVEL[base]}.{suffix}"
    _, layer, part = base.split(".")
    return f"model.layers.{layer}.{(GEMMA3_PER_LAYER if gemma3 else PER_LAYER)[part]}.{suffix}"


def write_reference_directory(gguf_path: str, out: Path, config: dict) -> Path:
    """An MLX directory of ``config`` holding the GGUF's tensors as the gguf package
    dequantizes them (a Gemma's norms with llama.cpp's + 1 taken off), which mlx-lm's
    own loader reads."""
    import mlx.core as mx

    gemma3 = config["model_type"] == "gemma3_text"
    weights = {}
    for name, array in reference_tensors(gguf_path).items():
        if gemma3 and name.endswith("norm.weight"):
            array = array - np.float32(1)
        weights[mlx_lm_name(name, gemma3)] = mx.array(array)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    return out
