"""`spmd-cp generate`: prefill a (long) prompt across the ranks and stream the answer.

    mpiexec -n 2 spmd-cp generate --prompt-file long.txt --max-tokens 200
    mpiexec -n 2 spmd-cp generate --load-cache /tmp/doc --prompt "And then?" --json
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import click

from ..config import DecodeConfig, GenerateConfig, RunConfig, SamplingConfig, from_options
from .options import (common_options, decode_options, prompt_options, ranged_option,
                      sampling_options)


@click.command()
@common_options
@click.option("--prompt", default=None, help="Prompt text, or - to read standard input.")
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None, help="Read the prompt from a file.")
@prompt_options
@sampling_options
@ranged_option("--seed", "seed", int, "Seed of rank 0's sampler (default: unseeded).")
@click.option("--stop", multiple=True, help="Stop when this string appears (repeatable).")
@click.option("--save-cache", default=None, metavar="DIR",
              help="After answering, save every rank's KV shard and the conversation here.")
@click.option("--load-cache", default=None, metavar="DIR",
              help="Continue a conversation saved with --save-cache (same model and rank "
                   "count): only the new tokens are prefilled.")
@decode_options
def generate(**options):
    """Generate a continuation of a (long) prompt."""
    from .steps import run_spmd

    settings = from_options(options, RunConfig, SamplingConfig, DecodeConfig, GenerateConfig)
    sys.exit(run_spmd(generate_command, *settings))


def generate_command(comm, run: RunConfig, sampling: SamplingConfig, decode: DecodeConfig,
                     args: GenerateConfig):
    import mlx.core as mx

    from ..engine.cache.cache import NO_REWIND
    from ..engine.generation import generate as generate_tokens
    from ..engine.cache.prompt_cache import save_cache
    from ..engine.startup import startup_fields, warm_up
    from ..run.builder import RunBuilder
    from ..runtime import spmd
    from . import steps
    from .stream import AnswerStream

    prompt_text, meta = spmd.on_root(comm, validate, run, sampling, args)
    builder = RunBuilder(comm, run, decode)
    checksum = builder.check().checksum
    if meta is not None:
        spmd.on_root(comm, refuse_other_model, meta, args.load_cache, checksum)
    loaded, engine = builder.load(), builder.engine()
    run = builder.run  # settled
    cache, conversation = open_cache(comm, engine, loaded, args, meta)
    prompt_ids, reused, forecast, max_tokens = spmd.on_root(
        comm, tokenize_prompt, comm, loaded, run, sampling, args, cache, conversation,
        prompt_text, decode.decode_tp != "off")
    sampling.max_tokens = max_tokens  # within the context, the same on every rank
    cache.truncate(reused)
    # Nothing truncates it back after this prompt; a cache to be saved keeps every key
    # (a later prompt may share less of it).
    cache.rewinds_to = 0 if args.save_cache else NO_REWIND
    steps.log.info("prefill: %d prompt tokens (%d from the prompt cache) on %d ranks",
                   len(prompt_ids), reused, comm.size)
    warmup_s = warm_up(engine)
    mx.reset_peak_memory()
    answer = AnswerStream(steps.log) if comm.rank == 0 else None
    with answer or nullcontext():
        result = generate_tokens(engine, cache, prompt_ids[reused:], loaded.tokenizer, sampling,
                                 write=answer.write if answer else None)
    if args.save_cache:
        text = comm.bcast_object(result.text if comm.rank == 0 else None)
        save_cache(comm, cache, args.save_cache, loaded.checksum,
                   steps.extend_conversation(conversation, prompt_text, text), engine.grid)
    metrics = steps.rank_metrics(comm, cache, steps.model_bytes(engine, loaded), engine.grid)
    if comm.rank == 0:
        report(comm, run, engine, result, len(prompt_ids), reused,
               {**startup_fields(engine, warmup_s),
                "decode_setup_s": round(result.decode_setup_s, 6),
                "memory_forecast": forecast, **metrics})


def validate(run: RunConfig, sampling: SamplingConfig, args: GenerateConfig):
    """Rank 0, before anything heavy: the text arguments, the prompt, the cache to
    continue, the outputs."""
    from ..engine.cache.prompt_cache import META, read_meta
    from ..text_input import check_text
    from .outputs import Output, check_outputs, claim_outputs
    from .steps import model_inputs, read_prompt, trace_output

    # First: nothing is claimed for a run that cannot tokenize its own arguments.
    for flag, text in (("--prompt", args.prompt), ("--system", args.system),
                       *(("--stop", stop) for stop in sampling.stop)):
        check_text(text, flag)
    # --save-cache may be the --load-cache directory: replacing a conversation by its
    # continuation is what --overwrite is for.
    cache_dir = Output("--save-cache", args.save_cache, directory=True,
                       writes=(META, "rank-*-of-*.safetensors"))
    # Before anything else: another run writing the same places is refused at once.
    claim_outputs([cache_dir, trace_output(run)])
    prompt = read_prompt(args.prompt, args.prompt_file, run)
    meta = None
    if args.load_cache:
        from .inputs import META_FACTOR, input_bound

        meta = read_meta(args.load_cache,
                         META_FACTOR * input_bound(run.max_context, run.model_path,
                                                   run.memory_limit))
    check_outputs([cache_dir, trace_output(run)],
                  {"the prompt file": [args.prompt_file], **model_inputs(run)}, run.overwrite)
    return prompt, meta


def refuse_other_model(meta: dict, directory: str, checksum: str):
    """A prompt cache holds one model's K/V: refuse another model before loading it."""
    from ..errors import UserError

    if meta.get("model_checksum") != checksum:
        raise UserError(f"prompt cache {directory} was made with another model "
                        f"(checksum {str(meta.get('model_checksum'))[:12]}..., this model "
                        f"{checksum[:12]}...); the model was not loaded")


def open_cache(comm, engine, loaded, args: GenerateConfig, meta: dict | None):
    """The sharded cache to prefill into, and the conversation it holds."""
    from ..engine.cache.prompt_cache import load_cache
    from .steps import log, new_conversation

    if meta is None:
        return engine.new_cache(), new_conversation(args.system)
    cache = load_cache(comm, args.load_cache, meta, loaded.checksum, engine.model.num_layers,
                       engine.model.kv_dtype, loaded.config.get("vocab_size"), engine.grid)
    log.info("prompt cache %s: %d tokens", args.load_cache, cache.num_tokens)
    return cache, meta["conversation"]


def tokenize_prompt(comm, loaded, run: RunConfig, sampling: SamplingConfig,
                    args: GenerateConfig, cache, conversation: dict, prompt: str,
                    may_split: bool):
    """Rank 0: the conversation's token ids, how many of them the cache holds, the
    memory forecast that let them run, and how many tokens may follow them in the
    model's context."""
    from ..config import sampling_problem
    from ..engine.cache.prompt_cache import common_prefix_length
    from ..errors import UserError
    from .steps import cap_to_context, check_memory, prompt_parts_for, tokenize_checked

    problem = sampling_problem(sampling, loaded.config.get("vocab_size"))
    if problem:
        raise UserError(problem.replace("top_k", "--top-k", 1))
    text, spans = prompt_parts_for(loaded, conversation, prompt, not args.no_chat_template)
    ids = tokenize_checked(loaded, text, run.max_context, user_spans=spans,
                           parse_special=run.parse_special)
    max_tokens = cap_to_context(sampling.max_tokens, len(ids),
                                run.max_context or loaded.max_context, "--max-tokens")
    forecast = check_memory(comm, loaded, run, len(ids) + max_tokens,
                            len(ids) - min(cache.num_tokens, len(ids) - 1),
                            split_decode=may_split and max_tokens > 1,
                            window_tail=None if args.save_cache else max_tokens)
    return ids, common_prefix_length(cache.token_ids, ids), forecast, max_tokens


def report(comm, run: RunConfig, engine, result, prompt_tokens: int, reused: int,
           metrics: dict):
    """Rank 0: the closing log line and the --json summary."""
    import json

    from .steps import algos_used, log, throughput, write_stdout

    summary = {
        "text": result.text,
        "tokens": len(result.tokens),
        "token_ids": [int(t) for t in result.tokens],
        "prompt_tokens": int(prompt_tokens),
        "prompt_tokens_reused": int(reused),
        "ranks": comm.size,
        **engine.grid.as_dict(),
        "algo": algos_used(engine),
        **engine.decode_modes,
        "finish_reason": result.finish_reason,
        "ttft_s": round(result.prefill_s, 6),
        "prefill_tok_s": throughput(prompt_tokens - reused, result.prefill_s),
        "decode_tok_s": throughput(max(len(result.tokens) - 1, 0), result.decode_s),
        **metrics,
    }
    log.info("prompt: %d tokens, %.1f tok/s | generation: %d tokens, %.1f tok/s | peak memory %s",
             summary["prompt_tokens"], summary["prefill_tok_s"], summary["tokens"],
             summary["decode_tok_s"],
             "/".join(f"{v / 2**30:.2f}GB" for v in metrics["peak_mem_bytes"]))
    if run.as_json:
        write_stdout(json.dumps(summary) + "\n")
