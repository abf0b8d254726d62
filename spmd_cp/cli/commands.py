"""The bodies of the CLI commands, run on every rank inside the SPMD runtime.

Order inside each command: validate on rank 0 (cheap, before anything heavy), load the
model on every rank (agreeing on errors), tokenize on rank 0 and broadcast the ids, run
the engine, gather per-rank metrics to rank 0, print.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..runtime import spmd
from ..blas import describe_blas
from ..models.checksum import model_checksum
from ..runtime.comm import Comm
from ..engine.engine import Engine
from ..errors import UserError
from ..runtime.faults import layer_hook
from ..engine.forecast import check_fits, default_memory_limit, parse_bytes
from ..engine.generation import SamplingOptions, generate
from ..models.loader import check_model_path, default_model_path, load_model
from ..engine.model import CPModel
from ..engine.prompt_cache import common_prefix_length, load_cache, read_meta, save_cache

log = spmd.log


def run_command(name: str, options: dict) -> int:
    body = {"generate": generate_command, "score": score_command}[name]
    return spmd.run_main(body, options)


# -- shared steps -----------------------------------------------------------------
def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt text from --prompt TEXT, --prompt - (stdin) or --prompt-file F (rank 0)."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt TEXT, --prompt - or --prompt-file FILE")
    if prompt_file is not None:
        return read_text_file(prompt_file, "prompt file")
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


def read_text_file(path: str, what: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {what} {path}: {error}") from None
    if not text.strip():
        raise UserError(f"{what} is empty: {path}")
    return text


def check_writable(path: str, directory: bool = False):
    """Refuse an output path we could not write, before any heavy work.

    With ``directory``, the path's parent is a directory we may create.
    """
    parent = Path(path).resolve().parent
    if directory:
        parent = next((p for p in [parent, *parent.parents] if p.exists()), parent)
    if not parent.is_dir():
        raise UserError(f"output directory does not exist: {parent}")
    if not os.access(parent, os.W_OK) or (Path(path).exists() and not os.access(path, os.W_OK)):
        raise UserError(f"output is not writable: {path}")


def resolve_model(comm: Comm, options: dict):
    """Check the model path on every rank (it may be missing on one host), then load it."""
    spmd.require_same(comm, "package versions", spmd.software_versions())
    path = options["model_path"] or spmd.on_root(comm, default_model_path)
    spmd.everywhere(comm, check_model_path, path)
    start = time.perf_counter()
    spmd.require_same(comm, "model file checksum", spmd.everywhere(comm, model_checksum, path))
    loaded = spmd.everywhere(comm, load_model, path, options["keep_quantized"])
    # From here on every rank is in lockstep: a long wait means a peer is gone.
    spmd.hot_phase(comm, options.get("comm_timeout"))
    blas_info = describe_blas()
    log.info("model %s loaded in %.1fs; %s", loaded.path, time.perf_counter() - start,
             blas_info.get("summary", blas_info))
    return loaded


def tokenize_checked(loaded, text: str, max_context: int | None, reserve: int = 0) -> np.ndarray:
    """Token ids of ``text`` (rank 0), refusing an empty or over-long prompt."""
    ids = np.asarray(loaded.tokenizer.encode(text), np.int64)
    if ids.size == 0:
        raise UserError("the prompt is empty after tokenization")
    limit = max_context or loaded.max_context
    if limit is not None and ids.size + reserve > limit:
        extra = f" + {reserve} tokens to generate" if reserve else ""
        raise UserError(f"prompt has {ids.size} tokens{extra}, more than --max-context {limit}")
    return ids


def check_memory(comm: Comm, loaded, options: dict, total_tokens: int, new_tokens: int,
                 score: bool = False):
    """Refuse before prefill when the forecast per rank exceeds --memory-limit."""
    limit = (parse_bytes(options["memory_limit"]) if options.get("memory_limit")
             else default_memory_limit())
    chunk = options["prefill_chunk"] or new_tokens
    algo = "pass-kv" if options["cp_algo"] == "auto" else options["cp_algo"]
    need = check_fits(loaded.shape, model_nbytes(loaded.model), total_tokens, chunk, comm.size,
                      limit, algo, score)
    log.info("memory forecast per rank: %.2f GB (KV %.2f GB) of %.2f GB allowed",
             need.total / 2**30, need.kv / 2**30, limit / 2**30)


def rank_metrics(comm: Comm, cache, model_bytes: int) -> dict:
    """Per-rank lists (rank order) of memory, KV and communication figures, on rank 0."""
    mine = {"peak_mem_bytes": int(mx.get_peak_memory()), "kv_cache_bytes": int(cache.nbytes),
            "comm_bytes": int(comm.bytes_sent), "model_bytes": int(model_bytes),
            "kv_tokens": int(cache.shard_sizes[comm.rank])}
    gathered = comm.gather_object(mine)
    if comm.rank != 0:
        return {}
    return {name: [g[name] for g in gathered] for name in mine}


def model_nbytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def make_engine(comm: Comm, loaded, options: dict) -> Engine:
    return Engine(CPModel(loaded.model), comm, algo=options["cp_algo"],
                  prefill_chunk=options["prefill_chunk"],
                  on_layer=layer_hook(comm.rank, comm.watchdog),
                  kv_interleave=options.get("kv_interleave", 1),
                  decode_merge=options.get("decode_merge", "allgather"),
                  decode_tp=options.get("decode_tp", "off"))


def write_stdout(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()


# -- generate -----------------------------------------------------------------------
def new_conversation(system: str | None) -> dict:
    """What a prompt cache remembers of the exchange so far."""
    return {"messages": [{"role": "system", "content": system}] if system else [], "text": ""}


def prompt_text_for(loaded, conversation: dict, prompt: str, chat: bool) -> str:
    """The full text to tokenize: the conversation so far plus the new user prompt."""
    if chat and getattr(loaded.tokenizer, "has_chat_template", False):
        # A prompt file's trailing newline is not part of the question; small models
        # answer noticeably worse with it inside the user turn.
        messages = conversation["messages"] + [{"role": "user", "content": prompt.strip()}]
        return loaded.tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=True)
    return conversation["text"] + prompt


def extend_conversation(conversation: dict, prompt: str, answer: str) -> dict:
    messages = conversation["messages"] + [{"role": "user", "content": prompt.strip()},
                                           {"role": "assistant", "content": answer}]
    return {"messages": messages, "text": conversation["text"] + prompt + answer}


def generate_command(comm: Comm, options: dict):
    def validate():
        if options["max_tokens"] < 0:
            raise UserError(f"--max-tokens must be >= 0, got {options['max_tokens']}")
        prompt = read_prompt(options["prompt"], options["prompt_file"])
        meta = read_meta(options["load_cache"]) if options["load_cache"] else None
        if options["save_cache"]:
            check_writable(str(Path(options["save_cache"]) / "meta.json"), directory=True)
        return prompt, meta

    prompt_text, meta = spmd.on_root(comm, validate)
    loaded = resolve_model(comm, options)
    engine = make_engine(comm, loaded, options)
    if meta is not None:
        cache = load_cache(comm, options["load_cache"], meta, loaded.checksum,
                           engine.model.num_layers)
        conversation = meta["conversation"]
        log.info("prompt cache %s: %d tokens", options["load_cache"], cache.num_tokens)
    else:
        cache = engine.new_cache()
        conversation = new_conversation(options["system"])

    def tokenize():
        text = prompt_text_for(loaded, conversation, prompt_text, not options["no_chat_template"])
        ids = tokenize_checked(loaded, text, options["max_context"])
        check_memory(comm, loaded, options, len(ids) + options["max_tokens"],
                     len(ids) - min(cache.num_tokens, len(ids) - 1))
        return ids, common_prefix_length(cache.token_ids, ids)

    prompt_ids, reused = spmd.on_root(comm, tokenize)
    cache.truncate(reused)
    sampling = SamplingOptions(max_tokens=options["max_tokens"], temp=options["temp"],
                               top_p=options["top_p"], top_k=options["top_k"],
                               min_p=options["min_p"], seed=options["seed"],
                               stop=list(options["stop"]))
    log.info("prefill: %d prompt tokens (%d from the prompt cache) on %d ranks",
             len(prompt_ids), reused, comm.size)
    mx.reset_peak_memory()
    result = generate(engine, cache, prompt_ids[reused:], loaded.tokenizer, sampling,
                      write=write_stdout)
    if options["save_cache"]:
        answer = comm.bcast_object(result.text if comm.rank == 0 else None)
        save_cache(comm, cache, options["save_cache"], loaded.checksum,
                   extend_conversation(conversation, prompt_text, answer))
    metrics = rank_metrics(comm, cache, model_nbytes(loaded.model))
    if comm.rank != 0:
        return
    decoded = max(len(result.tokens) - 1, 0)
    new_tokens = len(prompt_ids) - reused
    summary = {
        "text": result.text,
        "tokens": len(result.tokens),
        "prompt_tokens": int(len(prompt_ids)),
        "prompt_tokens_reused": int(reused),
        "ranks": comm.size,
        "algo": ",".join(sorted(set(engine.algos_used))),
        "finish_reason": result.finish_reason,
        "ttft_s": round(result.prefill_s, 6),
        "prefill_tok_s": round(new_tokens / max(result.prefill_s, 1e-9), 3),
        "decode_tok_s": round(decoded / result.decode_s, 3) if decoded and result.decode_s > 0 else 0.0,
        **metrics,
    }
    write_stdout("\n")
    log.info("prompt: %d tokens, %.1f tok/s | generation: %d tokens, %.1f tok/s | peak memory %s",
             summary["prompt_tokens"], summary["prefill_tok_s"], summary["tokens"],
             summary["decode_tok_s"], format_bytes_list(metrics["peak_mem_bytes"]))
    if options["as_json"]:
        write_stdout(json.dumps(summary) + "\n")


def format_bytes_list(values) -> str:
    return "/".join(f"{v / 2**30:.2f}GB" for v in values)


# -- score ----------------------------------------------------------------------------
def score_command(comm: Comm, options: dict):
    def validate():
        check_writable(options["output"])
        return read_text_file(options["text_file"], "text file")

    text = spmd.on_root(comm, validate)
    loaded = resolve_model(comm, options)

    def tokenize():
        ids = tokenize_checked(loaded, text, options["max_context"])
        bos = getattr(loaded.tokenizer, "bos_token_id", None)
        if getattr(loaded.tokenizer, "add_bos_token", False) and bos is not None and ids[0] != bos:
            ids = np.concatenate([[bos], ids])
        check_memory(comm, loaded, options, len(ids), len(ids), score=True)
        return ids

    ids = spmd.on_root(comm, tokenize)
    engine = make_engine(comm, loaded, options)
    cache = engine.new_cache()
    mx.reset_peak_memory()
    start = time.perf_counter()
    _, records = engine.prefill(cache, ids, score=True)
    elapsed = time.perf_counter() - start
    metrics = rank_metrics(comm, cache, model_nbytes(loaded.model))
    if comm.rank != 0:
        return
    try:
        with open(options["output"], "w", encoding="utf-8") as out:
            for pos, token, logprob, argmax in zip(records.pos, records.token, records.logprob,
                                                   records.argmax):
                out.write(json.dumps({"pos": pos, "token": token, "logprob": logprob,
                                      "argmax": argmax}) + "\n")
    except OSError as error:
        raise UserError(f"cannot write {options['output']}: {error.strerror or error}") from None
    mean_nll = -float(np.mean(records.logprob)) if records.logprob else 0.0
    summary = {
        "ppl": math.exp(mean_nll),
        "tokens": int(len(ids)),
        "predicted": len(records.pos),
        "ranks": comm.size,
        "algo": ",".join(sorted(set(engine.algos_used))),
        "prefill_s": round(elapsed, 6),
        "prefill_tok_s": round(len(ids) / max(elapsed, 1e-9), 3),
        **metrics,
    }
    log.info("scored %d tokens: ppl %.3f, %.1f tok/s", len(ids), summary["ppl"],
             summary["prefill_tok_s"])
    if options["as_json"]:
        write_stdout(json.dumps(summary) + "\n")
