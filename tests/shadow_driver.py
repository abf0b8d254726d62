"""Quantized shadows (models/quantized_shadows.py, kernels/gemv_forward.c) against numpy.

Run as a script (the re-exec preloads the forward): random matrices quantized by MLX,
dequantized to float32 as a GGUF load does (float32 scales and biases), registered, then
MLX's decode-shaped products checked against float64 numpy on the float32 matrices, and
how many products the shadows served. Then GGUF's other block types: random blocks of
each (tests/gguf_files.py), the float32 matrix ``gguf.quants.dequantize`` makes of them.
``SHADOW_DRIVER_PART=blocks`` runs the block types alone (a build without the vector
kernels registers nothing else). Prints one line: RESULT {json}.
"""

import ctypes
import json
import os

from spmd_cp import blas

blas.ensure_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from gguf_files import random_tensor  # noqa: E402
from spmd_cp.kernels.gemv_forward import lend_pool  # noqa: E402
from spmd_cp.models.packed_load import released_columns  # noqa: E402
from spmd_cp.models.quantized_shadows import (  # noqa: E402
    BLOCK_TYPES, SHADOWS, Blocks, Packed, available)

rng = np.random.default_rng(0)


def packed_matrix(rows: int, cols: int, bits: int, group: int, kind=mx.float16):
    """(float32 matrix, its Packed form): scales and biases stored as ``kind`` (float16
    as a GGUF file holds them, bfloat16 as MLX models do), the matrix dequantized from
    them in float32 arithmetic (numpy, independently of MLX's dequantize)."""
    dense = mx.array(rng.standard_normal((rows, cols)).astype(np.float32))
    words, scales, biases = mx.quantize(dense, group_size=group, bits=bits)
    packed = Packed.of(words, scales.astype(kind), biases.astype(kind), bits, group)
    mx.eval(packed.weight, packed.scales, packed.biases)
    per_word = 32 // bits
    q = (np.array(words)[:, :, None] >> (bits * np.arange(per_word, dtype=np.uint32))) & \
        np.uint32((1 << bits) - 1)
    q = q.reshape(rows, cols).astype(np.float32)
    widen = lambda a: np.repeat(np.array(a.astype(mx.float32)), group, axis=1)  # noqa: E731
    # two roundings (a product, then a sum), as MLX's CPU dequantization computes
    values = (q * widen(packed.scales)).astype(np.float32) + widen(packed.biases)
    assert np.array_equal(values, np.array(packed.dequantized()))
    return mx.array(values), packed


def measured(product, reference: np.ndarray) -> dict:
    """The product's relative error against float64 numpy, and the products served."""
    before = SHADOWS.products()
    got = np.array(product(), np.float64)
    served = SHADOWS.products() - before
    error = float(np.abs(got - reference).max() / max(np.abs(reference).max(), 1e-30))
    return {"error": error, "served": served}


def row(cols: int) -> mx.array:
    return mx.array(rng.standard_normal((1, cols)).astype(np.float32))


def random_rows(count: int, cols: int) -> mx.array:
    return mx.array(rng.standard_normal((count, cols)).astype(np.float32))


def times_transposed(x: mx.array, weights: mx.array) -> dict:
    wanted = np.array(x, np.float64) @ np.array(weights, np.float64).T
    return measured(lambda: x @ weights.T, wanted)


def affine_cases(cases: dict, registered: dict) -> dict:
    """MLX's affine triples: registrations, products, refusals."""
    for name, shape in {"q4g32": (1536, 576, 4, 32), "q8g32": (300, 576, 8, 32),
                        "q4g64": (128, 256, 4, 64, mx.bfloat16),
                        "q8g64": (96, 512, 8, 64, mx.float32),
                        "other": (200, 576, 4, 32), "third": (40, 576, 8, 32)}.items():
        weights, packed = packed_matrix(*shape)
        registered[name] = SHADOWS.register(weights, packed)
        cases[name] = times_transposed(row(shape[1]), weights)
        if name == "q4g64":  # bfloat16 scales, a column copy: a strided view of their bits
            copy = mx.contiguous(weights[:, 64:192])
            SHADOWS.register_columns(copy, weights, 64, 192)
            cases["columns bfloat16"] = times_transposed(row(128), copy)
        if name == "q4g32":
            big, big_packed = weights, packed
        elif name == "other":
            other = MATRICES["affine 576"] = weights
        elif name == "third":
            third = weights

    # A view of whole rows of a registered matrix: found by its address.
    cases["rows"] = times_transposed(row(576), big[100:700])
    # Copies of columns, their shadow a view of the packed columns: 288 wide ends in half
    # a block of 4-bit weights; 64 wide starts inside the packed rows.
    for start, stop in [(64, 352), (32, 96)]:
        copy = MATRICES[f"copy {start}:{stop}"] = mx.contiguous(big[:, start:stop])
        mx.eval(copy)
        SHADOWS.register_columns(copy, big, start, stop)
        cases[f"columns {start}:{stop}"] = times_transposed(row(stop - start), copy)
    # Rows of three registered matrices (4- and 8-bit) copied into one: one product reads
    # across the three shadows.
    sources = [big[1000:], other, third[:10]]
    stacked = mx.concatenate(sources)
    mx.eval(stacked)
    SHADOWS.register_stacked(stacked, sources)
    cases["stacked"] = times_transposed(row(576), stacked)
    # alpha and beta (c = alpha x W.T + beta c)
    x, c = row(576), row(1536)
    wanted = 0.5 * np.array(x, np.float64) @ np.array(big, np.float64).T + 2.0 * np.array(c)
    cases["alpha beta"] = measured(lambda: mx.addmm(c, x, big.T, alpha=0.5, beta=2.0), wanted)
    # A few rows at once (a batched decode step's, up to 32) read the packed form once
    # for all of them; 33 rows are the BLAS's.
    cases["rows 2"] = times_transposed(random_rows(2, 576), big)
    cases["rows 9 stacked"] = times_transposed(random_rows(9, 576), stacked)
    cases["rows 32 columns"] = times_transposed(random_rows(32, 288), MATRICES["copy 64:352"])
    cases["rows 33"] = times_transposed(random_rows(33, 576), big)

    # Refusals: one weight a float32 step off, a second registration of the same memory, a
    # bit width the kernel does not read. Products of a refused matrix are the BLAS's.
    weights, packed = packed_matrix(64, 576, 4, 32)
    nudged = np.array(weights)
    nudged[7, 300] = np.nextafter(nudged[7, 300], np.float32(np.inf))
    nudged = mx.array(nudged)
    refusals = {"nudged": SHADOWS.register(nudged, packed),
                "again": SHADOWS.register(big, big_packed),
                "2-bit": SHADOWS.register(*packed_matrix(64, 576, 2, 32))}
    cases["nudged"] = times_transposed(row(576), nudged)

    return refusals


def block_matrix(kind: str, rows: int, cols: int):
    """(float32 matrix, its Blocks): random blocks of GGUF type ``kind``, the matrix as the
    gguf package's reference dequantizes them (independently of spmd-cp's code)."""
    import gguf
    from gguf.quants import dequantize

    qtype = gguf.GGMLQuantizationType[kind]
    data = np.ascontiguousarray(random_tensor(kind, (rows, cols), block_rng))
    values = np.asarray(dequantize(data, qtype), np.float32).reshape(rows, cols)
    return mx.array(values), Blocks(data, int(qtype), cols)


def block_cases(cases: dict, registered: dict) -> dict:
    """Per type: a whole matrix, a view of its rows, a copy of columns on block boundaries
    (served) and one off them (no shadow: the BLAS); the same float32 matrix with one
    block byte changed is refused. Then rows of three types' matrices copied into one,
    and alpha and beta."""
    refusals, matrices = {}, {}
    for kind in BLOCK_TYPES:
        values = 256 if kind.endswith("_K") or kind == "IQ4_XS" else 32
        rows, cols = 96, 768 if values == 256 else 576
        weights, blocks = block_matrix(kind, rows, cols)
        changed = np.array(blocks.data)
        changed[rows // 2, 5] ^= 0x11  # a byte of one block (values or sub-block scales)
        refusals[f"{kind} changed"] = SHADOWS.register(mx.array(np.array(weights)),
                                                       Blocks(changed, blocks.kind, cols))
        registered[kind] = SHADOWS.register(weights, blocks)
        matrices[kind] = MATRICES[kind] = weights
        cases[kind] = times_transposed(row(cols), weights)
        cases[f"{kind} rows"] = times_transposed(row(cols), weights[10:70])
        cases[f"{kind} batch"] = times_transposed(random_rows(8, cols), weights)
        for start, stop, name in [(values, 3 * values, "columns"), (16, 16 + values, "off")]:
            copy = mx.contiguous(weights[:, start:stop])
            mx.eval(copy)
            SHADOWS.register_columns(copy, weights, start, stop)
            cases[f"{kind} {name}"] = times_transposed(row(stop - start), copy)
    # Rows of three types' matrices copied into one: one product across three shadows.
    sources = [matrices["Q4_K"][5:40], matrices["Q6_K"], matrices["IQ4_XS"][:7]]
    stacked = mx.concatenate(sources)
    mx.eval(stacked)
    SHADOWS.register_stacked(stacked, sources)
    cases["blocks stacked"] = times_transposed(row(768), stacked)
    x, c, big = row(768), row(96), matrices["Q6_K"]
    wanted = 0.5 * np.array(x, np.float64) @ np.array(big, np.float64).T + 2.0 * np.array(c)
    cases["blocks alpha beta"] = measured(lambda: mx.addmm(c, x, big.T, alpha=0.5, beta=2.0),
                                          wanted)
    return refusals


block_rng = np.random.RandomState(1)
MATRICES = {}  # registered matrices by name
cases, registered, refusals = {}, {}, {}
if os.environ.get("SHADOW_DRIVER_PART") != "blocks":
    refusals.update(affine_cases(cases, registered))
# From here a few rows' products run on the decode step's pool of threads (the affine
# ones above on their caller's).
pool_threads = lend_pool(2)
refusals.update(block_cases(cases, registered))
if "affine 576" in MATRICES:
    # q/k/v rows of block and affine matrices copied into one (a split step's joined
    # q/k/v): block and affine shadows read across in one product.
    sources = [MATRICES["Q5_0"][:30], MATRICES["affine 576"], MATRICES["IQ4_NL"][50:]]
    stacked = mx.concatenate(sources)
    mx.eval(stacked)
    SHADOWS.register_stacked(stacked, sources)
    cases["mixed stacked"] = times_transposed(row(576), stacked)



def reference_columns(x: mx.array, values: np.ndarray) -> np.ndarray:
    return np.array(x, np.float64) @ values.astype(np.float64).T


def released_cases(cases: dict) -> dict:
    """Matrices whose float32 memory is handed back (a packed-only load): their memory
    reads as zeros after, yet a prefill's many rows (tiles dequantized for the BLAS), one
    row (the packed kernel), a row view, a stacked copy and an embedding's lookup all
    give the float32 matrix's answers; ``filled`` puts the values back for a copy."""
    checks = {}
    names = [n for n in ("affine 576", "Q4_K", "Q6_K", "IQ4_XS", "Q5_0") if n in MATRICES]
    for name in names:
        weights = MATRICES[name]
        values = np.array(weights)  # the float32 matrix, kept here as the reference
        many = mx.array(rng.standard_normal((33, weights.shape[1])).astype(np.float32))
        ids = np.array([0, 7, weights.shape[0] - 1, 7], np.int32)
        limit = mx.get_memory_limit()
        SHADOWS.release(weights)
        # MLX's limit grows by the released bytes: its headroom for real buffers stays
        checks[f"{name} limit"] = mx.get_memory_limit() - limit == weights.size * 4
        interior = np.asarray(weights).reshape(-1)[2048:-2048]
        checks[f"{name} reads zeros"] = bool(interior.size and not interior.any())
        reference = np.array(many, np.float64) @ values.astype(np.float64).T
        cases[f"{name} released rows"] = measured(lambda: many @ weights.T, reference)
        cases[f"{name} released row"] = measured(
            lambda: many[:1] @ weights.T, reference[:1])
        cases[f"{name} released few rows"] = measured(
            lambda: many[:8] @ weights.T, reference[:8])
        cases[f"{name} released view"] = measured(
            lambda: many @ weights[3:40].T, reference[:, 3:40])
        checks[f"{name} lookup"] = bool(np.array_equal(
            np.array(SHADOWS.lookup(weights, ids)), values[ids]))
        with SHADOWS.filled([weights]):
            copy = mx.contiguous(weights[:, :64])
            mx.eval(copy)
        checks[f"{name} filled copy"] = bool(np.array_equal(np.array(copy), values[:, :64]))
        checks[f"{name} released again"] = not np.asarray(weights).reshape(-1)[2048:-2048].any()
        # Columns on block boundaries as a name of their own over the packed columns (the
        # split decode step's down): no values, its row's product the packed kernel's
        block = 256 if name in ("Q4_K", "Q6_K", "IQ4_XS") else 32
        columns = released_columns(weights, block, 2 * block)
        checks[f"{name} columns hold no values"] = columns is not None and \
            not np.asarray(columns).reshape(-1)[2048:-2048].any()
        cases[f"{name} released columns row"] = measured(
            lambda: many[:1, block:2 * block] @ columns.T, reference_columns(
                many[:1, block:2 * block], values[:, block:2 * block]))
    return checks


if os.environ.get("SHADOW_DRIVER_RELEASE") == "misuse":
    # A product that reads released memory as the BLAS's own operand: the process stops.
    weights = MATRICES["Q4_K"]
    SHADOWS.release(weights)
    mx.eval(weights @ mx.ones((weights.shape[1], 3)))
    print("RESULT {}", flush=True)
    raise SystemExit(0)
released = released_cases(cases) if os.environ.get("SHADOW_DRIVER_PART") != "blocks" else {}


def timed_sample() -> dict:
    """decode_plan's timing of packed reads over a sample (``timed_reads``): the bytes of
    every matrix with a shadow, the products of the sample's alone (two rounds)."""
    from mpi4py import MPI

    from spmd_cp.runtime.comm import Comm

    matrices = [m for m in MATRICES.values() if SHADOWS.packed_of(m) is not None]
    before = SHADOWS.products()
    total, seconds = SHADOWS.timed_reads(matrices, Comm(MPI.COMM_SELF), matrices[0].nbytes)
    return {"all bytes": total == sum(m.nbytes for m in matrices), "seconds": seconds,
            "products": SHADOWS.products() - before, "matrices": len(matrices)}


def two_rows() -> dict:
    """Batched products with the affine rows two at a time (the AVX-512VL kernels, where
    the CPU has them) against one at a time: whether both give the same bits, whether
    the shadows served both, and whether the two-row kernels ran here."""
    switch = ctypes.CDLL(None).spmd_cp_forward_two_rows
    equal, here = {}, bool(switch(1))
    # rows of x that outgrow the first-level cache (where rows are paired): 8 rows of 4-bit
    # weights, 3 (the even / odd sums), 8 ending in half a block, 8 rows of 8-bit weights
    for name, (rows, cols, bits, m) in {"4-bit": (66, 1536, 4, 8), "4-bit 3 rows": (66, 4096, 4, 3),
                                        "4-bit half block": (66, 1568, 4, 8),
                                        "8-bit": (66, 1536, 8, 8)}.items():
        weights, packed = packed_matrix(rows, cols, bits, 32)
        assert SHADOWS.register(weights, packed)
        x = random_rows(m, cols)
        before, got = SHADOWS.products(), []
        for allowed in (1, 0):
            switch(allowed)
            got.append(np.array(x @ weights.T))
        equal[name] = bool(np.array_equal(*got)) and SHADOWS.products() - before == 2
    switch(1)
    return {"here": here, "equal": equal}


def wide_blocks() -> dict:
    """One row's products of the block types that have 512-bit kernels (AVX-512F, where
    the CPU has it) with them and without (the 256-bit kernels), and 11 rows' (a batched
    step's: the 32-value types' many-rows kernel, eight rows and then three), each against
    float64 numpy; whether the shadows served them and whether the wide kernels ran here."""
    switch = ctypes.CDLL(None).spmd_cp_forward_wide_blocks
    here, results = bool(switch(1)), {}
    # the 32-value types in an odd count of blocks (their kernels take two at a time), a
    # Q4_K and a Q6_K row of three blocks
    for kind, cols in (("Q4_0", 608), ("Q4_1", 608), ("Q5_0", 608), ("Q8_0", 608),
                       ("Q4_K", 768), ("Q6_K", 768)):
        weights, blocks = block_matrix(kind, 40, cols)
        assert SHADOWS.register(weights, blocks)
        x, rows = row(cols), random_rows(11, cols)
        for allowed, name in ((1, "wide"), (0, "narrow")):
            switch(allowed)
            results[f"{kind} {name}"] = times_transposed(x, weights)
            results[f"{kind} {name} rows"] = times_transposed(rows, weights)
    switch(1)
    return {"here": here, "cases": results}


# Whether the block kernels run as vector code here (a plain C build: not)
block_vectors = bool(ctypes.CDLL(None).spmd_cp_block_shadow_vectors())
print("RESULT " + json.dumps({"available": available(), "block_vectors": block_vectors,
                              "pool_threads": pool_threads,
                              "registered": registered,
                              "refusals": refusals, "refused": SHADOWS.refused,
                              "released": released, "timed sample": timed_sample(),
                              "two rows": two_rows() if os.environ.get(
                                  "SHADOW_DRIVER_PART") != "blocks" else None,
                              "wide blocks": wide_blocks(),
                              "cases": cases}), flush=True)
