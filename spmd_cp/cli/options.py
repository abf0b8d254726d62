"""The flags of the commands that run the model, declared once from spmd_cp.config.

Defaults come from the settings classes, ranges from ``SAMPLING_RANGES``; generate and
batch share the sampling and decode flags. Names and meanings: docs/USAGE.md.
"""

from __future__ import annotations

import click

from ..config import (ATTENTION_KERNELS, DECODE_COMM_MODES, DECODE_STEP_MODES,
                      DECODE_TP_MODES, DEVICES, GRAPH_BACKENDS, KV_DTYPES,
                      SHARD_WEIGHTS_MODES, DecodeConfig, RunConfig, SamplingConfig,
                      describe_range, in_range)


class RangeError(click.BadParameter):
    """A flag outside its declared range: printed as one ``spmd-cp: error:`` line."""


def range_check(name: str):
    """A click callback refusing values outside ``SAMPLING_RANGES[name]``."""
    def check(ctx, param, value):
        if not in_range(name, value):
            raise RangeError(f"{param.opts[0]} must be {describe_range(name)}, got {value}")
        return value

    return check


def _not_nan(ctx, param, value):
    if value is not None and value != value:
        raise RangeError(f"{param.opts[0]} must be a number of seconds >= 0, got nan")
    return value


# The rank process alone (interpreter, MLX, mpi4py, a tokenizer) holds more than this:
# a smaller limit refuses every job, so it is refused as a typo (1KB for 1GB) at once.
MIN_MEMORY_LIMIT = 64 << 20


def _memory_size(ctx, param, value):
    """--memory-limit: a size parse_bytes reads, at least MIN_MEMORY_LIMIT (kept as text)."""
    from ..engine.cache.forecast import describe_bytes, parse_bytes
    from ..errors import UserError

    if value is None:
        return value
    try:
        size = parse_bytes(value)
    except UserError as error:
        raise RangeError(f"{param.opts[0]}: {error}") from None
    if size < MIN_MEMORY_LIMIT:
        raise RangeError(f"{param.opts[0]} must be at least {describe_bytes(MIN_MEMORY_LIMIT)} "
                         f"(the rank process alone holds more), got {value} "
                         f"({describe_bytes(size)})")
    return value


def memory_limit_option(default):
    return click.option("--memory-limit", default=default, callback=_memory_size,
                        metavar="SIZE",
                        help="Refuse jobs whose forecast of resident memory exceeds this per "
                             "rank, e.g. 2GB (default: this host's memory / its ranks).")


def _apply(fn, options):
    for option in reversed(options):
        fn = option(fn)
    return fn


def device_options(fn):
    """How the model is loaded and computed (RunConfig): every command that loads one,
    doctor included."""
    d = RunConfig.default
    return _apply(fn, [
        click.option("--device", type=click.Choice(DEVICES), default=d("device"),
                     show_default=True,
                     help="Compute path: gpu (MLX's fused attention, the KV cache and "
                          "messages in the model's dtype) or cpu (tiled float32 attention); "
                          "auto: from MLX's default device. Every rank must take the same."),
        click.option("--attention-kernel", type=click.Choice(ATTENTION_KERNELS),
                     default=d("attention_kernel"), show_default=True,
                     help="Attention alone: MLX's fused kernel or the tiled float32 blocks "
                          "(auto: fused on the GPU path)."),
        click.option("--weight-cache/--no-weight-cache", default=d("weight_cache"),
                     show_default=True,
                     help="Keep a GGUF's dequantized float32 weights under "
                          "$SPMD_CP_CACHE/weights (4 bytes a parameter of disk; saves the "
                          "dequantization, seconds per rank and run)."),
    ])


def grid_option(fn):
    """``--tp``: the ranks as context-parallel groups of tensor-parallel ranks; ``--afd``:
    as attention ranks and FFN ranks."""
    fn = click.option(
        "--afd", default=RunConfig.default("afd"), metavar="A:F",
        help="Attention-FFN disaggregation: the first A ranks run attention (context "
        "parallel, every KV), the other F hold the MLPs or experts and no KV; each layer's "
        "rows cross to them and back.")(fn)
    fn = click.option(
        "--afd-micro-batches", type=click.IntRange(min=1),
        default=RunConfig.default("afd_micro_batches"), show_default=True, metavar="M",
        help="With --afd: a layer's rows cross in M micro-batches, so an FFN rank computes "
        "one while the next arrives.")(fn)
    return click.option(
        "--tp", type=click.IntRange(min=1), default=RunConfig.default("tp"), show_default=True,
        metavar="T", help="Tensor-parallel groups of T ranks (T divides the ranks): each rank "
        "holds 1/T of every matrix and computes 1/T of every product; the N/T groups split "
        "the sequence (context parallel).")(fn)


def common_options(fn):
    """Flags shared by every command that runs the model (RunConfig)."""
    from ..attention import PREFILL_ALGOS

    d = RunConfig.default
    fn = device_options(grid_option(fn))
    return _apply(fn, [
        click.option("--model", "model_path", default=d("model_path"), metavar="PATH|ORG/NAME",
                     help="GGUF file, MLX/HF model directory, or a Hugging Face repo id "
                          "(fetched into the hub's cache once per host; HF_HOME and "
                          "HF_HUB_OFFLINE honoured). Default: embedded SmolLM2-135M-Instruct."),
        click.option("--cp-algo", type=click.Choice(PREFILL_ALGOS), default=d("cp_algo"),
                     show_default=True, help="Context-parallel prefill attention."),
        click.option("--prefill-chunk", type=click.IntRange(min=0), default=d("prefill_chunk"),
                     metavar="N", help="Prefill in chunks of N tokens (0: one chunk). Default: "
                     "2048 on the GPU path at one rank (mlx-lm's step), else one chunk."),
        click.option("--max-context", type=click.IntRange(min=1), default=d("max_context"),
                     help="Refuse prompts longer than this (default: the model's limit)."),
        click.option("--keep-quantized", is_flag=True,
                     help="Keep quantized weights (default on CPU: dequantize to float32, much faster)."),
        click.option("--quantized-decode/--no-quantized-decode", default=d("quantized_decode"),
                     show_default=True,
                     help="Decode reads a quantized model's 4/8-bit matrices packed (x86 CPUs "
                          "with AVX2/FMA/F16C), else their float32 copies."),
        click.option("--fast-exp/--no-fast-exp", default=d("fast_exp"), show_default=True,
                     help="Attention's exp and the MLP's SiLU as a compiled polynomial (x86 "
                          "CPU path), else MLX's own."),
        click.option("--json", "as_json", is_flag=True,
                     help="Print one JSON summary as the last stdout line."),
        memory_limit_option(d("memory_limit")),
        click.option("--shard-weights", type=click.Choice(SHARD_WEIGHTS_MODES),
                     default=d("shard_weights"), show_default=True,
                     help="Each rank holds only layers i mod N and 1/N of the vocabulary; a "
                          "layer's owner broadcasts it just before it runs (auto: when the "
                          "weights and the process's own memory exceed --memory-limit)."),
        click.option("--kv-dtype", type=click.Choice(KV_DTYPES), default=d("kv_dtype"),
                     show_default=True,
                     help="The KV cache's dtype on the CPU path (auto: float16 where decode "
                          "steps run natively, else float32); a half one is read into "
                          "float32. The GPU path keeps the model's dtype."),
        click.option("--comm-timeout", type=click.FloatRange(min=0), default=d("comm_timeout"),
                     callback=_not_nan,
                     help="Abort the job when a rank waits this many seconds for a peer during "
                          "prefill/decode (default 45; 0 disables)."),
        click.option("--trace", default=d("trace"), metavar="FILE",
                     help="Write a Chrome trace (Perfetto) of every rank's layers, waits and "
                          "transfers; see spmd-cp trace-summary."),
        click.option("--parse-special", is_flag=True,
                     help="Read control-token strings (<|im_start|>, ...) in prompts and "
                          "documents as control tokens (default: as plain text; only the "
                          "chat template makes control tokens)."),
        click.option("--overwrite", is_flag=True,
                     help="Replace existing output files (--output, --trace, --save-cache)."),
        click.option("-v", "--verbose", is_flag=True, help="Log from every rank, not only rank 0."),
        click.option("-q", "--quiet", is_flag=True,
                     help="No info logs (errors and warnings still print)."),
        click.option("--fault", default=d("fault"), hidden=True, metavar="SPEC",
                     help="Test-only: inject a fault (spmd_cp/runtime/faults.py)."),
    ])


def ranged_option(flag: str, setting: str, kind, help: str):
    """A sampling flag with its SamplingConfig default and its SAMPLING_RANGES check."""
    return click.option(flag, setting, type=kind, default=SamplingConfig.default(setting),
                        show_default=True, callback=range_check(setting),
                        help=f"{help} Must be {describe_range(setting)}.")


def sampling_options(fn):
    """Sampling flags of generate and batch (batch: for jobs that set none of their own)."""
    return _apply(fn, [
        ranged_option("--max-tokens", "max_tokens", int, "Most tokens to generate."),
        ranged_option("--temp", "temp", float, "Sampling temperature (0 = greedy)."),
        ranged_option("--top-p", "top_p", float, "Nucleus sampling (0 = off)."),
        ranged_option("--top-k", "top_k", int, "Sample among the k likeliest tokens (0 = off)."),
        ranged_option("--min-p", "min_p", float,
                      "Drop tokens below this share of the likeliest one's probability (0 = off)."),
        click.option("--ignore-eos", is_flag=True,
                     help="Generate --max-tokens tokens even past the model's end-of-sequence "
                          "token (benchmarks that compare like with like)."),
    ])


def decode_options(fn):
    """Flags of the decode loop (generate, batch)."""
    from ..attention.gather import DECODE_MERGES

    d = DecodeConfig.default
    return _apply(fn, [
        click.option("--kv-interleave", type=click.IntRange(min=1), default=d("kv_interleave"),
                     show_default=True,
                     help="Generated tokens' K/V go to the least loaded rank in runs of this many."),
        click.option("--decode-merge", type=click.Choice(DECODE_MERGES),
                     default=d("decode_merge"), show_default=True,
                     help="How decode merges the ranks' partial attention each layer."),
        click.option("--decode-tp", type=click.Choice(DECODE_TP_MODES), default=d("decode_tp"),
                     show_default=True,
                     help="Split decode's projections, MLP and LM head across ranks too "
                          "(auto: when the calibrated weight read and collective times say "
                          "it pays)."),
        click.option("--decode-comm", type=click.Choice(DECODE_COMM_MODES),
                     default=d("decode_comm"), show_default=True,
                     help="Decode's collectives: inside MLX's graph (mlx: over MLX's MPI "
                          "backend on this job's MPICH, else its ring backend; "
                          "--graph-backend picks), through mpi4py (mpi), or mlx where "
                          "every rank can (auto)."),
        click.option("--graph-backend", type=click.Choice(GRAPH_BACKENDS),
                     default=d("graph_backend"), show_default=True,
                     help="MLX's backend for decode's graph collectives: its MPI backend "
                          "(mpi), its ring backend (ring), or MPI where every rank can build "
                          "the ABI adapter, else the ring (auto)."),
        click.option("--decode-step", type=click.Choice(DECODE_STEP_MODES),
                     default=d("decode_step"), show_default=True,
                     help="Decode step body: C calls between MPI collectives (native, CPU "
                          "path), MLX's graph (graph), or native where every rank can (auto)."),
    ])


def prompt_options(fn):
    """How a prompt becomes the model's input (generate, batch)."""
    return _apply(fn, [
        click.option("--system", default=None, help="System message for the chat template."),
        click.option("--no-chat-template", is_flag=True, help="Feed the prompt as is."),
    ])
