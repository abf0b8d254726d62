"""kernels/decode_step.c's calls against float64 numpy, on one random layer.

Run as a script (the re-exec puts the BLAS, and the forward, in the global scope the
library takes cblas_sgemm from). The layer has what the models on the native path may
have: q/k/v rows in two pieces with biases (Qwen2), q/k norms (Qwen3), 12 query heads
over one KV head (more than the attention kernels' 8 rows), and the merge is checked
with an empty shard; a sliding window's rows (attention from a first row on), and
Gemma 3's MLP (GELU's tanh form, its output and the attention's normed before each
residual add); and a batched step's calls (batch_step.h) on three rows. Prints one line:
RESULT {json} (each check's relative error).
"""

import ctypes
import json

from spmd_cp import blas

blas.ensure_fast_blas()

import numpy as np  # noqa: E402

from spmd_cp.kernels.decode_step import (ACTIVATIONS, KV_KINDS, MAX_PIECES,  # noqa: E402
                                         BatchAttention, Layer, Matrix, library)

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
              CAPACITY, SCALE, KV_KINDS["float32"])
ref = ctypes.byref(layer)
result = {}

# qkv: h plus what the previous layer added, normed, times the two pieces (with biases)
h, added = f32(DIM), f32(DIM)
h_start = h.copy()
wanted_h = h.astype(np.float64) + added
normed, qkv = np.zeros(DIM, np.float32), np.zeros((HEADS + 2 * KV) * D, np.float32)
library.spmd_cp_decode_qkv(ref, h.ctypes.data, added.ctypes.data, normed.ctypes.data,
                           qkv.ctypes.data)
x = rms(wanted_h, norm_in)
wanted_qkv = np.concatenate([wq @ x + bq, wkv @ x + bkv])
result["qkv"] = error(qkv, wanted_qkv)

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
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, rotation.ctypes.data, CACHED, 0,
                              CACHED + 1, 1, scratch.ctypes.data, out.ctypes.data)
result["stored_key"] = error(keys[:, CACHED], k)
result["stored_value"] = error(values[:, CACHED], v)
result["attention"] = error(out.reshape(HEADS, D), wanted_attention)

# the same on a pool of three threads: the products split by rows, attention by ranges
# of the cache (more parts than a 2-row cache has rows: empty ranges merge too), merged
THREADS = 3
layer.q_norm = layer.k_norm = None  # q/k already normed and rotated in place above
assert library.spmd_cp_decode_set_threads(THREADS) == THREADS
scratch = np.zeros(library.spmd_cp_decode_scratch(HEADS, D, CAPACITY), np.float32)
qkv_threads = np.zeros_like(qkv)
library.spmd_cp_decode_qkv(ref, h_start.ctypes.data, added.ctypes.data, normed.ctypes.data,
                           qkv_threads.ctypes.data)
result["threads_qkv"] = error(qkv_threads, wanted_qkv)
for length, name in ((CACHED + 1, "threads_attention"), (2, "threads_two_rows")):
    out_threads = np.zeros(HEADS * D, np.float32)
    library.spmd_cp_decode_attend(ref, qkv.ctypes.data, None, -1, 0, length, 1,
                                  scratch.ctypes.data, out_threads.ctypes.data)
    p2 = np.exp(scores[:, :length] - scores[:, :length].max(axis=1, keepdims=True))
    wanted = np.einsum("hk,hkd->hd", p2 / p2.sum(axis=1, keepdims=True),
                       np.repeat(all_values[:, :length], HEADS // KV, axis=0))
    result[name] = error(out_threads.reshape(HEADS, D), wanted)
partial_threads = np.zeros(HEADS * (D + 2), np.float32)
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, None, -1, 0, CACHED + 1, 0,
                              scratch.ctypes.data, partial_threads.ctypes.data)
merged_threads = np.zeros(HEADS * D, np.float32)
library.spmd_cp_decode_merge(1, HEADS, D, ctypes.c_float(SCALE), partial_threads.ctypes.data,
                             merged_threads.ctypes.data)
result["threads_partial"] = error(merged_threads.reshape(HEADS, D), wanted_attention)

# a sliding window: rows [5, CACHED + 1) only, on the pool (ranges split from row 5)
window_out = np.zeros(HEADS * D, np.float32)
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, None, -1, 5, CACHED + 1, 1,
                              scratch.ctypes.data, window_out.ctypes.data)
p_window = np.exp(scores[:, 5:] - scores[:, 5:].max(axis=1, keepdims=True))
wanted_window = np.einsum("hk,hkd->hd", p_window / p_window.sum(axis=1, keepdims=True),
                          np.repeat(all_values[:, 5:], HEADS // KV, axis=0))
result["window_attention"] = error(window_out.reshape(HEADS, D), wanted_window)

# the same over three "ranks": the first 9 entries, the rest, and an empty shard; the
# q/k/v already normed and rotated in place above, so no rotation and no norms now
layer.q_norm = layer.k_norm = None
width = D + 2
partials = np.zeros((3, HEADS * width), np.float32)
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, None, -1, 0, 9, 0, scratch.ctypes.data,
                              partials[0].ctypes.data)
rest_keys = np.ascontiguousarray(keys[:, 9:])
rest_values = np.ascontiguousarray(values[:, 9:])
layer.keys, layer.values, layer.capacity = (rest_keys.ctypes.data, rest_values.ctypes.data,
                                            CAPACITY - 9)
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, None, -1, 0, CACHED + 1 - 9, 0,
                              scratch.ctypes.data, partials[1].ctypes.data)
library.spmd_cp_decode_attend(ref, qkv.ctypes.data, None, -1, 0, 0, 0, scratch.ctypes.data,
                              partials[2].ctypes.data)
result["empty_partial_max"] = float(partials[2].reshape(HEADS, width)[:, -1].max())
merged = np.zeros(HEADS * D, np.float32)
library.spmd_cp_decode_merge(3, HEADS, D, ctypes.c_float(SCALE), partials.ctypes.data,
                             merged.ctypes.data)
result["merged"] = error(merged.reshape(HEADS, D), wanted_attention)


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, rounded to nearest even (MLX's conversion)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def widened(bits: np.ndarray, kind: str) -> np.ndarray:
    if kind == "float16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# a half-precision cache: the new token's k/v stored rounded to nearest even (the bits
# numpy / MLX round to), attention over the widened cache in float32 against float64;
# rows of 2 and 3 tokens exercise the vector kernels' tails (D = 16: two lanes of 8)
for kind in ("float16", "bfloat16"):
    half_keys = np.zeros((KV, CAPACITY, D), np.uint16)
    half_values = np.zeros((KV, CAPACITY, D), np.uint16)
    to_bits = (lambda x: np.asarray(x, np.float32).astype(np.float16).view(np.uint16)) \
        if kind == "float16" else bfloat16_bits
    half_keys[:, :CACHED], half_values[:, :CACHED] = (to_bits(keys[:, :CACHED]),
                                                      to_bits(values[:, :CACHED]))
    layer.keys, layer.values, layer.capacity = (half_keys.ctypes.data,
                                                half_values.ctypes.data, CAPACITY)
    layer.kv_kind = KV_KINDS[kind]
    new_qkv = qkv.copy()  # already normed and rotated: no rotation, no norms
    out_half = np.zeros(HEADS * D, np.float32)
    library.spmd_cp_decode_attend(ref, new_qkv.ctypes.data, None, CACHED, 0, CACHED + 1, 1,
                                  scratch.ctypes.data, out_half.ctypes.data)
    k_new, v_new = new_qkv[HEADS * D:(HEADS + KV) * D], new_qkv[(HEADS + KV) * D:]
    result[f"{kind}_stored_bits"] = float(
        np.count_nonzero(half_keys[:, CACHED].reshape(-1) != to_bits(k_new))
        + np.count_nonzero(half_values[:, CACHED].reshape(-1) != to_bits(v_new)))
    wide_k = widened(half_keys[:, :CACHED + 1], kind)
    wide_v = widened(half_values[:, :CACHED + 1], kind)
    s_half = np.einsum("hd,hkd->hk", new_qkv[:HEADS * D].reshape(HEADS, D),
                       np.repeat(wide_k, HEADS // KV, axis=0)) * SCALE
    p_half = np.exp(s_half - s_half.max(axis=1, keepdims=True))
    p_half /= p_half.sum(axis=1, keepdims=True)
    wanted_half = np.einsum("hk,hkd->hd", p_half, np.repeat(wide_v, HEADS // KV, axis=0))
    result[f"{kind}_attention"] = error(out_half.reshape(HEADS, D), wanted_half)

# a long half-precision cache on one thread: 301 keys take the vector kernels' blocks of
# four keys with one left over and their tiles of 128 values (sums carried from tile to
# tile), three query heads on one KV head (a chunk of three query rows)
assert library.spmd_cp_decode_set_threads(1) == 1
LONG, GROUP = 301, 3
layer.heads = GROUP
long_qkv = f32((GROUP + 2) * D)
long_keys, long_values = f32(1, LONG, D), f32(1, LONG, D)
long_scratch = np.zeros(library.spmd_cp_decode_scratch(GROUP, D, LONG), np.float32)
for kind in ("float16", "bfloat16"):
    to_bits = (lambda x: np.asarray(x, np.float32).astype(np.float16).view(np.uint16)) \
        if kind == "float16" else bfloat16_bits
    half_keys, half_values = to_bits(long_keys), to_bits(long_values)
    layer.keys, layer.values, layer.capacity = (half_keys.ctypes.data,
                                                half_values.ctypes.data, LONG)
    layer.kv_kind = KV_KINDS[kind]
    out_long = np.zeros(GROUP * D, np.float32)
    library.spmd_cp_decode_attend(ref, long_qkv.ctypes.data, None, -1, 0, LONG, 1,
                                  long_scratch.ctypes.data, out_long.ctypes.data)
    s_long = long_qkv[:GROUP * D].reshape(GROUP, D).astype(np.float64) @ \
        widened(half_keys[0], kind).T * SCALE
    p_long = np.exp(s_long - s_long.max(axis=1, keepdims=True))
    wanted_long = (p_long / p_long.sum(axis=1, keepdims=True)) @ widened(half_values[0], kind)
    result[f"{kind}_long_attention"] = error(out_long.reshape(GROUP, D), wanted_long)
layer.heads = HEADS
assert library.spmd_cp_decode_set_threads(THREADS) == THREADS
layer.keys, layer.values, layer.capacity = keys.ctypes.data, values.ctypes.data, CAPACITY
layer.kv_kind = KV_KINDS["float32"]

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

# Gemma 3's MLP: the attention's output normed before the residual add, GELU (tanh form,
# also where it saturates: the gate's bias reaches +-100), the MLP's output normed
layer.gate, layer.up, layer.down = matrix(wg, big), matrix(wu), matrix(wd)
norm_attention_out, norm_mlp_out = (1 + f32(DIM, scale=0.1) for _ in range(2))
layer.activation = ACTIVATIONS["gelu_approx"]
layer.attention_out_norm, layer.mlp_out_norm = (norm_attention_out.ctypes.data,
                                                norm_mlp_out.ctypes.data)
layer.attention_out_eps = layer.mlp_out_eps = EPS
h_before = h.astype(np.float64)
library.spmd_cp_decode_mlp(ref, h.ctypes.data, o_part.ctypes.data, scratch_mlp.ctypes.data,
                           mlp_part.ctypes.data)
wanted_h = h_before + rms(o_part, norm_attention_out)
result["gemma_residual"] = error(h, wanted_h)
x = rms(wanted_h, norm_post)
g = wg.astype(np.float64) @ x + big
gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
result["gemma_mlp"] = error(mlp_part, rms(wd @ (gelu * (wu @ x)), norm_mlp_out))
layer.activation, layer.attention_out_norm, layer.mlp_out_norm = 0, None, None

head_w, logits = f32(30, DIM), np.zeros(30, np.float32)
head = matrix(head_w)
h_before = h.astype(np.float64)
library.spmd_cp_decode_head(ctypes.byref(head), DIM, h.ctypes.data, added.ctypes.data,
                            norm_in.ctypes.data, ctypes.c_float(EPS), normed.ctypes.data,
                            logits.ctypes.data)
result["head"] = error(logits, head_w @ rms(h_before + added, norm_in))
# A batched step (batch_step.h): three rows, each at a position of its own (its own
# RoPE matrix), over the cache as the shared prefix (on the pool of three threads) and
# each row's own tail in a slot; row 1's tail is empty, rows 0 and 2 store their new
# key and value; without a window and with one (each row from its own first key).
ROWS, TAIL_CAP, WIDTH = 3, 8, (HEADS + 2 * KV) * D
layer.keys, layer.values, layer.capacity = keys.ctypes.data, values.ctypes.data, CAPACITY
layer.kv_kind, layer.q_norm, layer.k_norm = KV_KINDS["float32"], q_norm.ctypes.data, \
    k_norm.ctypes.data
prefix = CACHED + 1
h_rows, added_rows = f32(ROWS, DIM), f32(ROWS, DIM)
wanted_rows = h_rows.astype(np.float64) + added_rows
qkv_rows, normed_rows = np.zeros((ROWS, WIDTH), np.float32), np.zeros((ROWS, DIM), np.float32)
library.spmd_cp_batch_qkv(ref, ROWS, h_rows.ctypes.data, added_rows.ctypes.data,
                          normed_rows.ctypes.data, qkv_rows.ctypes.data)
x_rows = rms(wanted_rows, norm_in)
result["batch_qkv"] = error(qkv_rows, np.concatenate([x_rows @ wq.T + bq, x_rows @ wkv.T + bkv],
                                                     axis=1))
rotations = [np.linalg.qr(rng.standard_normal((D, D)))[0].astype(np.float32)
             for _ in range(ROWS)]
tail_keys, tail_values = f32(ROWS, KV, TAIL_CAP, D), f32(ROWS, KV, TAIL_CAP, D)
before = [3, 0, 5]  # each slot's entries before the step
stores = np.array([3, -1, 5], np.int32)
tail_lengths = np.array([4, 0, 6], np.int32)
slots = np.array([0, 1, 2], np.int32)
rotation_addresses = (ctypes.c_void_p * ROWS)(*[r.ctypes.data for r in rotations])
q_rows = rms(qkv_rows[:, :HEADS * D].reshape(ROWS, HEADS, D), q_norm)
k_rows = rms(qkv_rows[:, HEADS * D:(HEADS + KV) * D].reshape(ROWS, KV, D), k_norm)
v_rows = qkv_rows[:, (HEADS + KV) * D:].reshape(ROWS, KV, D).astype(np.float64)
q_rows = np.stack([q_rows[r] @ rotations[r] for r in range(ROWS)])
k_rows = np.stack([k_rows[r] @ rotations[r] for r in range(ROWS)])
for name, firsts, tail_firsts in (("batch_attention", None, [0, 0, 0]),
                                  ("batch_window", [5, 12, 0], [2, 0, 4])):
    tk, tv = tail_keys.copy(), tail_values.copy()
    first_array = None if firsts is None else np.array(firsts, np.int32)
    tail_first_array = np.array(tail_firsts, np.int32)
    attention = BatchAttention(ROWS, ctypes.cast(rotation_addresses, ctypes.c_void_p),
                               stores.ctypes.data, slots.ctypes.data,
                               None if first_array is None else first_array.ctypes.data,
                               prefix, tk.ctypes.data, tv.ctypes.data, TAIL_CAP,
                               tail_first_array.ctypes.data, tail_lengths.ctypes.data)
    scratch_batch = np.zeros(library.spmd_cp_batch_scratch(HEADS, KV, D, ROWS, prefix,
                                                           TAIL_CAP), np.float32)
    partials_batch = np.zeros((ROWS, HEADS, D + 2), np.float32)
    step_qkv = qkv_rows.copy()
    library.spmd_cp_batch_attend(ref, ctypes.byref(attention), step_qkv.ctypes.data,
                                 scratch_batch.ctypes.data, partials_batch.ctypes.data)
    out_rows = np.zeros((ROWS, HEADS, D), np.float32)
    library.spmd_cp_batch_merge(1, ROWS * HEADS, D, ctypes.c_float(SCALE),
                                partials_batch.ctypes.data, partials_batch.size,
                                out_rows.ctypes.data)
    wanted = []
    for r in range(ROWS):
        if stores[r] >= 0:
            result[f"{name}_stored_{r}"] = error(tk[r, :, stores[r]], k_rows[r])
        start = 0 if firsts is None else firsts[r]
        seen_k = np.concatenate([keys[:, start:prefix], tk[r, :, tail_firsts[r]:tail_lengths[r]]],
                                axis=1).astype(np.float64)
        seen_v = np.concatenate([values[:, start:prefix],
                                 tv[r, :, tail_firsts[r]:tail_lengths[r]]], axis=1)
        s_r = np.einsum("hd,hkd->hk", q_rows[r], np.repeat(seen_k, HEADS // KV, axis=0)) * SCALE
        p_r = np.exp(s_r - s_r.max(axis=1, keepdims=True))
        wanted.append(np.einsum("hk,hkd->hd", p_r / p_r.sum(axis=1, keepdims=True),
                                np.repeat(seen_v.astype(np.float64), HEADS // KV, axis=0)))
    result[name] = error(out_rows, np.stack(wanted))
    result[f"{name}_tail_kept"] = error(tk[0, :, :before[0]], tail_keys[0, :, :before[0]])

o_rows, mlp_rows = f32(ROWS, DIM), np.zeros((ROWS, DIM), np.float32)
h_before = h_rows.astype(np.float64)
scratch_rows = np.zeros(ROWS * (DIM + 2 * HIDDEN), np.float32)
library.spmd_cp_batch_mlp(ref, ROWS, h_rows.ctypes.data, o_rows.ctypes.data,
                          scratch_rows.ctypes.data, mlp_rows.ctypes.data)
x_rows = rms(h_before + o_rows, norm_post)
gate_rows = x_rows @ wg.T + big
result["batch_mlp"] = error(mlp_rows, (gate_rows / (1 + np.exp(-gate_rows)) * (x_rows @ wu.T))
                            @ wd.T)
logits_rows, final_rows = np.zeros((ROWS, 30), np.float32), np.zeros((ROWS, DIM), np.float32)
h_before = h_rows.astype(np.float64)
library.spmd_cp_batch_final_norm(ROWS, DIM, h_rows.ctypes.data, added_rows.ctypes.data,
                                 norm_in.ctypes.data, ctypes.c_float(EPS), final_rows.ctypes.data)
library.spmd_cp_batch_product(ctypes.byref(head), ROWS, final_rows.ctypes.data,
                              logits_rows.ctypes.data, 30)
result["batch_head"] = error(logits_rows, rms(h_before + added_rows, norm_in) @ head_w.T)
print("RESULT " + json.dumps(result))
