"""An independent float64 numpy forward pass of a llama-architecture GGUF model.

Written from the architecture's definition, sharing no code with mlx-lm or spmd_cp: MLX is used
only to read the file (`mx.load`) and to unpack quantized blocks (`mx.dequantize`). Weights keep
their GGUF names and layout: matrices are (out_features, in_features), and the Q/K rows are in
the interleaved RoPE layout (pairs (2i, 2i+1)) that llama.cpp's converter writes.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np


def _scalar(meta, key, default=None):
    v = meta.get(key, default)
    return v.item() if isinstance(v, mx.array) else v


@functools.lru_cache(maxsize=2)
def load_reference_weights(gguf_path: str) -> tuple[dict, dict]:
    """(GGUF-named float64 numpy weights, hyper-parameters) of a llama GGUF file."""
    tensors, meta = mx.load(gguf_path, return_metadata=True)
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(f"numpy reference only implements 'llama', not {arch!r}")
    weights = {}
    for name, t in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        base = name.rsplit(".", 1)[0]
        if base + ".scales" in tensors:
            s, b = tensors[base + ".scales"], tensors[base + ".biases"]
            bits = t.shape[-1] // s.shape[-1]  # uint32 words per group of 32 values = bits
            # MLX only unpacks the integers (scale 1, minimum 0: exact small integers);
            # q * d + m is computed here in float64 from the blocks' float16 d and m.
            q = mx.dequantize(t, mx.ones(s.shape, mx.float32), mx.zeros(b.shape, mx.float32),
                              group_size=32, bits=bits)
            q = np.array(q, dtype=np.float64).reshape(*s.shape, 32)
            d = np.array(s.astype(mx.float32), dtype=np.float64)[..., None]
            m = np.array(b.astype(mx.float32), dtype=np.float64)[..., None]
            weights[name] = (q * d + m).reshape(q.shape[0], -1)
            continue
        weights[name] = np.array(t.astype(mx.float32), dtype=np.float64)
    hp = {
        "n_layers": _scalar(meta, "llama.block_count"),
        "n_heads": _scalar(meta, "llama.attention.head_count"),
        "n_kv_heads": _scalar(meta, "llama.attention.head_count_kv"),
        "eps": _scalar(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_base": _scalar(meta, "llama.rope.freq_base", 10000.0),
    }
    return weights, hp


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_interleaved(x, base):
    """Rotate pairs (2i, 2i+1) of each head by pos * base**(-2i/d). x: (heads, T, d)."""
    _, T, d = x.shape
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # (d/2,)
    angle = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]  # (T, d/2)
    cos, sin = np.cos(angle), np.sin(angle)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def attention(x, W, i, hp):
    """Causal grouped-query softmax attention of layer i. x: (T, hidden)."""
    T = x.shape[0]
    H, KV = hp["n_heads"], hp["n_kv_heads"]
    q = (x @ W[f"blk.{i}.attn_q.weight"].T).reshape(T, H, -1).transpose(1, 0, 2)
    k = (x @ W[f"blk.{i}.attn_k.weight"].T).reshape(T, KV, -1).transpose(1, 0, 2)
    v = (x @ W[f"blk.{i}.attn_v.weight"].T).reshape(T, KV, -1).transpose(1, 0, 2)
    d = q.shape[-1]
    q, k = rope_interleaved(q, hp["rope_base"]), rope_interleaved(k, hp["rope_base"])
    # Query head h reads key/value head h // (H / KV).
    k, v = np.repeat(k, H // KV, axis=0), np.repeat(v, H // KV, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)  # (H, T, T)
    scores = np.where(np.tril(np.ones((T, T), dtype=bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = (p @ v).transpose(1, 0, 2).reshape(T, H * d)
    return out @ W[f"blk.{i}.attn_output.weight"].T


def mlp(x, W, i):
    """SwiGLU: down(silu(gate x) * up x)."""
    g = x @ W[f"blk.{i}.ffn_gate.weight"].T
    u = x @ W[f"blk.{i}.ffn_up.weight"].T
    return (g / (1.0 + np.exp(-g)) * u) @ W[f"blk.{i}.ffn_down.weight"].T


def reference_logits(gguf_path: str, token_ids) -> np.ndarray:
    """(T, vocab) float64 logits of a llama GGUF model on token_ids (positions 0..T-1)."""
    W, hp = load_reference_weights(gguf_path)
    eps = hp["eps"]
    x = W["token_embd.weight"][np.asarray(token_ids)]
    for i in range(hp["n_layers"]):
        x = x + attention(rms_norm(x, W[f"blk.{i}.attn_norm.weight"], eps), W, i, hp)
        x = x + mlp(rms_norm(x, W[f"blk.{i}.ffn_norm.weight"], eps), W, i)
    x = rms_norm(x, W["output_norm.weight"], eps)
    head = W.get("output.weight", W["token_embd.weight"])  # tied when the file has no output
    return x @ head.T
