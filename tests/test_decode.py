"""Decode over a sharded cache: prompt caches on disk, long greedy runs, shard balance."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
import pytest

from conftest import TESTS, run_cli, run_ranks

DOCUMENT = ("The city of Lyon lies at the confluence of the Rhone and the Saone. It was "
            "founded by the Romans as Lugdunum in 43 BC and became the capital of Gaul. ") * 6


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode")
    (root / "doc.txt").write_text(DOCUMENT + "\nWhat river meets the Rhone at Lyon?")
    return root


def test_follow_up_from_saved_cache_equals_whole_conversation_from_scratch(files, tmp_path,
                                                                         tiny_models):
    cache = tmp_path / "cache"
    model = ["--model", tiny_models["llama"]]  # the embedded model's tokenizer and template
    first = run_cli(2, ["generate", *model, "--prompt-file", str(files / "doc.txt"),
                        "--max-tokens", "16", "--save-cache", str(cache), "--json"]).last_json()
    assert sorted(p.name for p in cache.iterdir()) == [
        "meta.json", "rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]
    follow_up = "When was the city founded?"
    resumed = run_cli(2, ["generate", *model, "--load-cache", str(cache), "--prompt", follow_up,
                          "--max-tokens", "16", "--json"]).last_json()
    # the default cache where decode runs natively: float16 (--kv-dtype auto)
    assert first["kv_dtype"] == resumed["kv_dtype"] == "float16"
    # Most of the conversation came from the cache: only the new turn was prefilled.
    assert resumed["prompt_tokens_reused"] >= first["prompt_tokens"]
    assert resumed["prompt_tokens"] - resumed["prompt_tokens_reused"] < 40

    # The same conversation, templated by the reference tokenizer and prefilled from scratch.
    from spmd_cp.models.loader import load_model

    tokenizer = load_model(tiny_models["llama"]).tokenizer
    messages = [{"role": "user", "content": (files / "doc.txt").read_text().strip()},
                {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": follow_up}]
    whole = tmp_path / "conversation.txt"
    whole.write_text(tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True))
    # Already templated: its control-token strings are the conversation's control tokens.
    scratch = run_cli(1, ["generate", *model, "--no-chat-template", "--parse-special",
                          "--prompt-file", str(whole),
                          "--max-tokens", "16", "--json"]).last_json()
    assert scratch["prompt_tokens"] == resumed["prompt_tokens"]
    assert resumed["text"] == scratch["text"]
    assert resumed["tokens"] == scratch["tokens"]


def test_overlapped_decode_loop_equals_the_lockstep_loop(tiny_models):
    """The overlapped loop (one rank on a GPU: step n+1 queued before token n reaches the
    host) against the lock-step loop, in this process on one real rank: same sampled
    tokens (same random stream), same stop, and the same cache left behind (the token
    that ends the generation is never fed)."""
    from mpi4py import MPI

    from spmd_cp.runtime.comm import Comm
    from spmd_cp.engine.engine import Engine
    from spmd_cp.config import SamplingConfig
    from spmd_cp.engine.generation import generate
    from spmd_cp.models.loader import load_model
    from spmd_cp.engine.model import CPModel

    loaded = load_model(tiny_models["llama"])
    # "auto", as the CLI passes it: on one rank the plan is the replicated layout, made
    # once, without measuring anything.
    engine = Engine(CPModel(loaded.model), Comm(MPI.COMM_SELF))
    plan = engine.prepare_decode()
    assert (plan.layout, plan.transport, plan.inputs) == ("replicated", "none", {})
    assert engine.prepare_decode() is plan
    prompt = np.array(loaded.tokenizer.encode(DOCUMENT))

    def run(overlap: bool, stop: str | None = None):
        cache = engine.new_cache()
        options = SamplingConfig(max_tokens=12, temp=0.9, seed=11, stop=[stop] if stop else [])
        result = generate(engine, cache, prompt, loaded.tokenizer, options, overlap=overlap)
        keys = np.concatenate([np.array(layer.fetch()[0]) for layer in cache.layers])
        return result, cache, keys

    free = {overlap: run(overlap) for overlap in (True, False)}
    stop = free[False][0].text[len(free[False][0].text) // 3:][:4]  # met part-way
    stopped = {overlap: run(overlap, stop) for overlap in (True, False)}
    assert stopped[False][0].finish_reason == "stop" and len(stopped[False][0].tokens) < 12
    for runs in (free, stopped):
        (a, cache_a, keys_a), (b, cache_b, keys_b) = runs[True], runs[False]
        assert (a.tokens, a.text, a.finish_reason) == (b.tokens, b.text, b.finish_reason)
        assert cache_a.num_tokens == cache_b.num_tokens
        assert cache_a.token_ids.tolist() == cache_b.token_ids.tolist()
        assert -1 not in cache_a.token_ids.tolist()
        assert (cache_a.decode_steps, cache_a.decode_owner) == (cache_b.decode_steps,
                                                                cache_b.decode_owner)
        np.testing.assert_array_equal(keys_a, keys_b)


def test_positions_and_token_ids_grow_in_place_as_plain_concatenation_would():
    """The cache's per-rank positions and token ids (buffers that double as they fill)
    through prefill-like and decode-like appends, truncation and rollback: equal to
    numpy concatenation and filtering of the same records, step by step."""
    from spmd_cp.engine.cache.cache import ShardedKVCache

    cache = ShardedKVCache(num_layers=1, cp_rank=1, cp_size=3)
    want_positions = [np.zeros(0, np.int64) for _ in range(3)]
    want_ids = np.zeros(0, np.int64)
    rng = np.random.default_rng(4)

    def append(counts):
        nonlocal want_ids
        start, pieces = cache.num_tokens, []
        for count in counts:
            pieces.append(np.arange(start, start + count))
            start += count
        ids = rng.integers(0, 1000, start - cache.num_tokens)
        cache.add_positions(pieces, ids)
        for rank, piece in enumerate(pieces):
            want_positions[rank] = np.concatenate([want_positions[rank], piece])
        want_ids = np.concatenate([want_ids, ids])

    def check():
        for got, want in zip(cache.rank_positions, want_positions):
            assert got.tolist() == want.tolist()
        assert cache.token_ids.tolist() == want_ids.tolist()
        assert cache.positions.tolist() == want_positions[1].tolist()
        assert cache.num_tokens == want_ids.size == sum(p.size for p in want_positions)

    append([40, 30, 50])  # a prefill
    check()
    for step in range(300):  # decode tokens, one rank at a time: the buffers grow
        append([1 if rank == step % 3 else 0 for rank in range(3)])
        check()
    cache.truncate(200)  # back to a shared document
    want_positions = [p[p < 200] for p in want_positions]
    want_ids = want_ids[:200]
    check()
    checkpoint = cache.checkpoint()
    append([5, 0, 7])
    cache.set_token(201, 17)
    want_ids[201] = 17
    check()
    cache.rollback(checkpoint)
    want_positions = [p[p < 200] for p in want_positions]
    want_ids = want_ids[:200]
    check()


def test_cache_room_is_what_its_buffers_take_within_a_growth_step():
    """What the server's memory forecast counts for a resident cache: its room, which the
    buffers' own sizes give, at most a growth step beyond the most it held since it
    last grew, and kept when the cache is cut back (engine/cache/cache.py)."""
    import mlx.core as mx

    from spmd_cp.engine.cache.cache import LayerKV, ShardedKVCache

    cache = ShardedKVCache(num_layers=2, cp_rank=0, cp_size=1)
    most = 0
    for count in (5, 300, 1, 250, 0, 40):
        for layer in cache.layers:
            block = mx.ones((3, count, 4))
            layer.update_and_fetch(block, block)
        cache.add_positions([np.arange(cache.num_tokens, cache.num_tokens + count)],
                            np.zeros(count, np.int64))
        most = max(most, cache.num_tokens)
        if count == 1:
            cache.truncate(cache.num_tokens - 3)  # an answer's last tokens dropped
        for layer in cache.layers:
            assert layer.keys.nbytes + layer.values.nbytes == 2 * 3 * 4 * 4 * cache.capacity
        assert cache.num_tokens <= cache.capacity <= most + LayerKV.step - 1
    room = cache.capacity
    cache.truncate(10)
    assert cache.capacity == room and cache.nbytes == 2 * 2 * 3 * 10 * 4 * 4


def test_a_window_layer_drops_the_keys_no_later_query_sees():
    """Rank 1 of 2 after a 40-token prefill whose owner may truncate back to 30 tokens:
    its windowed layer (window 8) keeps the entries of its positions from 23 on (a query
    at 30 sees 23..30), each still the key of its position, the global layer all of
    them; every rank's held positions follow from the floor alone. A truncation that
    would need a dropped key is refused; one to the promised 30 keeps positions 23..29,
    and an empty cache forgets the floor (engine/cache/cache.py)."""
    from spmd_cp.attention.partition import head_tail_positions
    from spmd_cp.engine.cache.cache import ShardedKVCache

    ranks = head_tail_positions(40, 2)
    cache = ShardedKVCache(num_layers=2, cp_rank=1, cp_size=2)
    cache.add_positions(ranks, np.arange(40))
    mine = ranks[1]
    for layer in cache.layers:  # each key holds its own position
        keys = mx.array(np.repeat(mine[None, :, None], 4, axis=2).astype(np.float32))
        layer.update_and_fetch(keys, keys)

    def held_keys(layer):
        return np.array(layer.fetch()[0])[0, :, 0].astype(np.int64).tolist()

    cache.rewinds_to = 30
    cache.drop_behind_window(0, 8)
    assert held_keys(cache.layers[0]) == [p for p in mine if p >= 23]
    assert cache.layer_positions(cache.layers[0]).tolist() == [p for p in mine if p >= 23]
    assert held_keys(cache.layers[1]) == mine.tolist()
    assert [p.tolist() for p in cache.rank_positions_within(8)] == [
        [p for p in r if p >= 23] for r in ranks]
    with pytest.raises(ValueError, match="sliding-window layers dropped the keys before 23"):
        cache.truncate(29)
    cache.truncate(30)
    assert held_keys(cache.layers[0]) == [p for p in mine if 23 <= p < 30]
    cache.truncate(0)
    assert (cache.layers[0].dropped, cache.window_floors, cache.nbytes) == (0, {}, 0)


def test_a_cache_filled_in_one_step_holds_contiguous_rows():
    """A layer's first append of exactly whole growth steps, in a half-precision cache,
    from a transposed view (as a projection's heads are): the buffers hold the values
    as contiguous rows, as the native decode step writes into them in place (an update
    of the whole buffer once came back as the transposed view itself)."""
    from spmd_cp.engine.cache.cache import LayerKV

    rng = np.random.default_rng(3)
    for n in (LayerKV.step, 2 * LayerKV.step, LayerKV.step - 1):
        layer = LayerKV(mx.float16)
        rows = rng.standard_normal((n, 3, 64)).astype(np.float32)
        keys = mx.array(rows).transpose(1, 0, 2)  # (heads, n, d), not contiguous
        layer.update_and_fetch(keys, keys * 2)
        mx.eval(layer.keys, layer.values)
        for buffer, scale in ((layer.keys, 1), (layer.values, 2)):
            view = np.asarray(buffer.view(mx.uint16))
            assert view.flags["C_CONTIGUOUS"], (n, view.strides)
            want = (scale * rows.transpose(1, 0, 2)).astype(np.float16)
            assert np.array_equal(np.asarray(buffer[:, :n]), want)


def test_rows_written_in_place_equal_the_same_rows_appended_by_mlx():
    """append_float32 (a native step's rows written back to a server's resident cache,
    through numpy views of the buffers) against update_and_fetch (MLX's update), for
    each cache dtype, across a growth step, after an append by MLX: equal entries."""
    from spmd_cp.engine.cache.cache import LayerKV

    rng = np.random.default_rng(5)
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        by_mlx, in_place = LayerKV(dtype), LayerKV(dtype)
        for n in (3, LayerKV.step, 5):  # the second crosses a growth step
            # values the cache's dtype holds exactly, as the native step's rows are
            k, v = (mx.array(rng.standard_normal((2, n, 64)), dtype).astype(mx.float32)
                    for _ in range(2))
            by_mlx.update_and_fetch(k, v)
            if n == 3:  # the first append by MLX on both: in place continues it
                in_place.update_and_fetch(k, v)
            else:
                in_place.append_float32(np.asarray(k), np.asarray(v))
        assert in_place.offset == by_mlx.offset == 3 + LayerKV.step + 5
        for ours, theirs in zip(in_place.fetch(), by_mlx.fetch()):
            assert ours.dtype == dtype and mx.array_equal(ours, theirs).item(), dtype


def test_cache_restored_from_its_state_decodes_like_the_original(tiny_models):
    """state()/from_state() (what prompt caches save and load) keep the K/V, positions,
    token ids and decode placement: the next decode step gives the same logits; and a
    checkpoint rolled back to undoes a decode step entirely."""
    from mpi4py import MPI

    from spmd_cp.config import DecodeConfig
    from spmd_cp.runtime.comm import Comm
    from spmd_cp.engine.cache.cache import ShardedKVCache
    from spmd_cp.engine.engine import Engine
    from spmd_cp.engine.model import CPModel
    from spmd_cp.models.loader import load_model

    loaded = load_model(tiny_models["llama"])
    engine = Engine(CPModel(loaded.model), Comm(MPI.COMM_SELF),
                    decode=DecodeConfig(kv_interleave=3))
    cache = engine.new_cache()
    engine.prefill(cache, np.array(loaded.tokenizer.encode(DOCUMENT))[:40])
    for token in (5, 6):
        engine.decode_step(cache, token)
    arrays, shared = cache.state()
    positions = [np.array(arrays["positions"])]
    restored = ShardedKVCache.from_state(engine.model.num_layers, 0, positions, arrays, shared)
    assert restored.checkpoint() == cache.checkpoint() == (42, 2, 0)
    assert restored.token_ids.tolist() == cache.token_ids.tolist()
    checkpoint = cache.checkpoint()
    expected = np.array(engine.decode_step(cache, 7))
    np.testing.assert_array_equal(np.array(engine.decode_step(restored, 7)), expected)
    cache.rollback(checkpoint)
    assert cache.checkpoint() == checkpoint and cache.positions.size == 42
    np.testing.assert_array_equal(np.array(engine.decode_step(cache, 7)), expected)
    with pytest.raises(ValueError, match="shard sizes"):
        ShardedKVCache.from_state(engine.model.num_layers, 0, [np.arange(41)], arrays, shared)


def test_sampled_decode_and_stop_strings_equal_on_one_and_two_ranks(files, tmp_path,
                                                                   tiny_models):
    """Sampled tokens (rank 0's random stream), the stop, and the cache left behind (the
    token that ends the generation is never fed) must not depend on the rank count.

    With a float32 cache: a half-precision one rounds keys that two layouts compute to
    float32 rounding apart into neighbouring halves now and then (1e-3 relative), which
    moves a temperature-0.9 draw from a random model's near-uniform 49K-token
    distribution to a neighbouring id within a dozen tokens (seen: the ninth); its
    layouts are held to a tolerance instead (test_native_decode.py)."""
    doc = str(files / "doc.txt")
    sampling = ["--model", tiny_models["llama"], "--temp", "0.9", "--seed", "11",
                "--max-tokens", "12", "--kv-dtype", "float32"]
    free = {n: run_cli(n, ["generate", "--prompt-file", doc, "--json", *sampling]).last_json()
            for n in (1, 2)}
    assert free[1]["tokens"] == free[2]["tokens"] == 12
    assert free[1]["text"] == free[2]["text"]
    stop = free[2]["text"][len(free[2]["text"]) // 3:][:6]  # a stop string met part-way
    metas = {}
    for n in (1, 2):
        run = run_cli(n, ["generate", "--prompt-file", doc, "--stop", stop, "--json",
                          "--save-cache", str(tmp_path / f"cache-{n}"), *sampling]).last_json()
        assert run["finish_reason"] == "stop" and run["tokens"] < 12, run
        assert stop not in run["text"] and free[2]["text"].startswith(run["text"])
        metas[n] = json.loads((tmp_path / f"cache-{n}" / "meta.json").read_text())
    for key in ("num_tokens", "token_ids", "decode_steps"):
        assert metas[1][key] == metas[2][key], key
    assert -1 not in metas[1]["token_ids"]
    assert metas[1]["shard_sizes"] == [metas[1]["num_tokens"]]


def refused(launch, *fragments):
    assert launch.returncode != 0
    errors = [line for line in launch.stderr.splitlines() if line.startswith("spmd-cp: error:")]
    assert len(errors) == 1, launch.stderr[-3000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def test_bad_caches_are_refused(files, tmp_path, tiny_models):
    cache = tmp_path / "cache"
    model = ["--model", tiny_models["llama"]]  # small: these runs are about the cache
    run_cli(2, ["generate", *model, "--prompt", "Hello", "--max-tokens", "2",
                "--save-cache", str(cache)])
    args = ["generate", *model, "--load-cache", str(cache), "--prompt", "Again",
            "--max-tokens", "2"]
    refused(run_cli(3, args, check=False), "made on 2 ranks", "this job has 3")
    refused(run_cli(2, args[:1] + ["--model", tiny_models["qwen3"]] + args[3:], check=False),
            "made with another model")
    shard = cache / "rank-1-of-2.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    refused(run_cli(2, args, check=False), "rank-1-of-2.safetensors is corrupt")
    (cache / "meta.json").write_text("{not json")
    refused(run_cli(2, args, check=False), "is corrupt (meta.json")
    refused(run_cli(2, ["generate", "--load-cache", str(tmp_path / "nowhere"), "--prompt", "x"],
                    check=False), "prompt cache not found")


def test_long_greedy_decode_matches_single_rank_for_every_algorithm(embedded_model, tmp_path):
    """500-token prompt, greedy: 64 tokens at N=1 vs N=2 and N=4; at N=2 also after every
    prefill algorithm (decode starts from that algorithm's cache), and 64 tokens with the
    split decode step from the first step and its collectives in MLX's graph (what
    `--decode-tp auto --decode-comm auto` runs on a CPU)."""
    driver = [sys.executable, str(TESTS / "mpi_exact_driver.py")]
    base = {"chunk": 0, "length": 500, "seed": 7, "score": False}
    configs = [{**base, "algo": "auto", "decode": 64}]
    configs += [{**base, "algo": a, "decode": 16} for a in ("pass-kv", "pass-q", "allgather-kv")]
    configs += [{**base, "algo": "auto", "decode": 64, "tp": "on", "comm": "mlx"}]
    results = {}
    for n in (1, 2, 4):
        out = tmp_path / f"long-{n}.json"
        run_ranks(n, driver + [embedded_model, json.dumps(configs if n == 2 else configs[:1]),
                               str(out)], timeout=600)
        results[n] = json.loads(out.read_text())["results"]
    reference = results[1][0]["greedy"]
    assert len(reference) == 64
    for n in (2, 4):
        for result in results[n]:
            steps = result["config"]["decode"]
            assert result["greedy"] == reference[:steps], (n, result["config"])
            sizes = result["shard_sizes"]
            assert max(sizes) - min(sizes) <= 1


def test_the_lm_head_divided_by_vocabulary_rows_gives_every_rank_all_logits(tmp_path):
    """Three real ranks divide a 1,000-row head (shares of 334, 334 and 332 rows, the
    last padded for the Allgather): a Linear with a bias and a tied embedding, each
    rank's logits (all 1,000) equal to numpy's norm(x) @ W.T (+ b)."""
    out = tmp_path / "head.json"
    run_ranks(3, [sys.executable, str(TESTS / "head_driver.py"), str(out)], timeout=120)
    result = json.loads(out.read_text())
    x = np.array(result["hidden"], np.float64)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * np.array(result["norm"])
    weights = result["weights"]
    expected = {"linear": normed @ np.array(weights["linear"]).T + np.array(weights["bias"]),
                "tied": normed @ np.array(weights["tied"]).T}
    for name, want in expected.items():
        assert result[name]["rows"] == [[0, 334], [334, 668], [668, 1000]]
        for logits in result[name]["logits"]:
            np.testing.assert_allclose(np.array(logits), want, rtol=1e-5, atol=1e-5)
