"""kernels/decode_step.c's calls against float64 numpy, on one random layer.

Run as a script (the re-exec puts the BLAS, and the forward, in the global scope the
library takes cblas_sgemm from). The layer has what the models on the native path may
have: q/k/v rows in two pieces with biases (Qwen2), q/k norms (Qwen3), 12 query heads
over one KV head (more than the attention kernels' 8 rows), and the merge is checked
with an empty shard. Prints one line: RESULT {json} (each check's relative error).
"""

import ctypes
import json

from spmd_cp import blas

blas.ensure_fast_blas()

import numpy as np  # noqa: E402

from spmd_cp.kernels.decode_step import MAX_PIECES, Layer, Matrix, library  # noqa: E402

rng = np.random.default_rng(1)
DIM, HEADS, KV, D, HIDDEN, CAPACITY, CACHED = 48, 12, 1, 16, 40, 32, 20
EPS, SCALE = 1e-5, D ** -0.5
library, why = library()
assert library is not None, why


def f32(*shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def matrix(weights, bias=None):
    return Matrix(weights.ctypes.data, None if bias is None else bias.ctypes.data,
                  weights.shape[0], weights.shape[1], weights.strides[0] // 4)


def rms(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + EPS) * w


def error(got, wanted) -> float:
    wanted = np.asarray(wanted, np.float64)
    return float(np.abs(np.asarray(got, np.float64) - wanted).max() / np.abs(wanted).max())


wq, wkv = f32(HEADS * D, DIM, scale=0.2), f32(2 * KV * D, DIM, scale=0.2)
bq, bkv = f32(HEADS * D), f32(2 * KV * D)
wo, wg, wu, wd = f32(DIM, HEADS * D, scale=0.1), f32(HIDDEN, DIM), f32(HIDDEN, DIM), \
    f32(DIM, HIDDEN, scale=0.1)
norm_in, norm_post, q_norm, k_norm = (1 + f32(n, scale=0.1) for n in (DIM, DIM, D, D))
keys, values = f32(KV, CAPACITY, D), f32(KV, CAPACITY, D)
keys[:, CACHED:] = values[:, CACHED:] = 0
rotation = np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32)
pieces = (Matrix * MAX_PIECES)(matrix(wq, bq), matrix(wkv, bkv))
layer = Layer(DIM, HEADS, KV, D, norm_in.ctypes.data, norm_post.ctypes.data, EPS, EPS,
              q_norm.ctypes.data, k_norm.ctypes.data, EPS, 2, pieces, matrix(wo),
              matrix(wg), matrix(wu), matrix(wd), keys.ctypes.data, values.ctypes.data,
              CAPACITY, SCALE)
ref = ctypes.byref(layer)
result = {}

# qkv: h plus what the previous layer added, normed, times the two pieces (with biases)
h, added = f32(DIM), f32(DIM)
wanted_h = h.astype(np.float64) + added
normed, qkv = np.zeros(DIM, np.float32), np.zeros((HEADS + 2 * KV) * D, np.float32)
library.spmd_cp_decode_qkv(ref, h.ctypes.data, added.ctypes.data, normed.ctypes.data,
                           qkv.ctypes.data)
x = rms(wanted_h, norm_in)
result["qkv"] = error(qkv, np.concatenate([wq @ x + bq, wkv @ x + bkv]))

# attention over the cache with the new token stored at row CACHED
q = rms(qkv[:HEADS * D].reshape(HEADS, D), q_norm) @ rotation
k = rms(qkv[HEADS * D:(HEADS + KV) * D].reshape(KV, D), k_norm) @ rotation
v = qkv[(HEADS + KV) * D:].reshape(KV, D).astype(np.float64)
all_keys = np.concatenate([keys[:, :CACHED], k[:, None]], axis=1).astype(np.float64)
all_values = np.concatenate([values[:, :CACHED], v[:, None]], axis=1).astype(np.float64)
scores = np.einsum("hd,hkd->hk", q, np.repeat(all_keys, HEADS // KV, axis=0)) * SCALE
probs = np.exp(scores - scores.max(axis=1, keepdims=True))
probs /= probs.sum(axis=1, keepdims=True)
wanted_attention = np.einsum("hk,hkd->hd", probs, np.repeat(all_values, HEADS // KV, axis=0))
scratch = np.zeros(HEADS * max(CAPACITY, D), np.float32)
out = np.zeros(HEADS * D, np.float32)
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, rotation.ctypes.data, CACHED,
                              CACHED + 1, 1, scratch.ctypes.data, out.ctypes.data)
result["stored_key"] = error(keys[:, CACHED], k)
result["stored_value"] = error(values[:, CACHED], v)
result["attention"] = error(out.reshape(HEADS, D), wanted_attention)

# the same over three "ranks": the first 9 entries, the rest, and an empty shard; the
# q/k/v already normed and rotated in place above, so no rotation and no norms now
layer.q_norm = layer.k_norm = None
width = D + 2
partials = np.zeros((3, HEADS * width), np.float32)
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, None, -1, 9, 0, scratch.ctypes.data,
                              partials[0].ctypes.data)
rest_keys = np.ascontiguousarray(keys[:, 9:])
rest_values = np.ascontiguousarray(values[:, 9:])
layer.keys, layer.values, layer.capacity = (rest_keys.ctypes.data, rest_values.ctypes.data,
                                            CAPACITY - 9)
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, None, -1, CACHED + 1 - 9, 0,
                              scratch.ctypes.data, partials[1].ctypes.data)
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, None, -1, 0, 0, scratch.ctypes.data,
                              partials[2].ctypes.data)
result["empty_partial_max"] = float(partials[2].reshape(HEADS, width)[:, -1].max())
merged = np.zeros(HEADS * D, np.float32)
library.spmd_cp_decode_merge(3, HEADS, D, ctypes.c_float(SCALE), partials.ctypes.data,
                             merged.ctypes.data)
result["merged"] = error(merged.reshape(HEADS, D), wanted_attention)

# output projection, then the MLP on h plus it
o_part = np.zeros(DIM, np.float32)
library.spmd_cp_decode_output(ref, out.ctypes.data, o_part.ctypes.data)
result["output"] = error(o_part, wo.astype(np.float64) @ out)
scratch_mlp = np.zeros(DIM + 2 * HIDDEN, np.float32)
mlp_part = np.zeros(DIM, np.float32)
h_before = h.astype(np.float64)
library.spmd_cp_decode_mlp(ref, h.ctypes.data, o_part.ctypes.data, scratch_mlp.ctypes.data,
                           mlp_part.ctypes.data)
result["residual"] = error(h, h_before + o_part)
x = rms(h, norm_post)
gate, up = wg @ x, wu @ x
result["mlp"] = error(mlp_part, wd @ (gate / (1 + np.exp(-gate)) * up))

# SwiGLU's exponential where it saturates (|g| up to 100) and the head
big = np.zeros(HIDDEN, np.float32)
big[:8] = [-100, -30, -10, -1e-3, 1e-3, 10, 30, 100]
wg_big = np.zeros_like(wg)
layer.gate = matrix(wg_big, big)  # gate = the bias alone
ones, zeros = np.ones(HIDDEN, np.float32), np.zeros(DIM, np.float32)
wu_zero, wd_eye = np.zeros_like(wu), np.eye(DIM, HIDDEN, dtype=np.float32)  # held: pointed to
layer.up, layer.down = matrix(wu_zero, ones), matrix(wd_eye)
library.spmd_cp_decode_mlp(ref, h.ctypes.data, zeros.ctypes.data, scratch_mlp.ctypes.data,
                           mlp_part.ctypes.data)
silu = big / (1 + np.exp(-big.astype(np.float64)))
result["silu"] = error(mlp_part[:HIDDEN], silu[:DIM])
head_w, logits = f32(30, DIM), np.zeros(30, np.float32)
head = matrix(head_w)
h_before = h.astype(np.float64)
library.spmd_cp_decode_head(ctypes.byref(head), DIM, h.ctypes.data, added.ctypes.data,
                            norm_in.ctypes.data, ctypes.c_float(EPS), normed.ctypes.data,
                            logits.ctypes.data)
result["head"] = error(logits, head_w @ rms(h_before + added, norm_in))
print("RESULT " + json.dumps(result))
