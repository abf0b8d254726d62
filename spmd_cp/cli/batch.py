"""spmd-cp batch: answer every job of a JSONL file; a shared document is prefilled once.

    mpiexec -n 2 spmd-cp batch --jobs jobs.jsonl --output results.jsonl [--resume]

Order of work, on every rank: rank 0 checks the whole jobs file and the output file
(nothing heavy yet), every rank loads the model, then group by group rank 0 reads and
tokenizes the jobs and broadcasts their ids, and all ranks prefill and decode together.
Jobs that share a ``prefix_file`` (and ``system``) run back to back: the tokens they all
begin with (chat header + document) are prefilled once into the sharded cache, each job
prefills only its own tail after them (pass-Q's case, docs/ALGORITHMS.md; decoded
together, a short tail is rows of a batched step) and generates, and the cache is
truncated back to the shared part. Results are written in input order
(jobs.ResultWriter holds early finishers). See docs/BATCH.md.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from contextlib import contextmanager

import click

from ..config import BatchConfig, DecodeConfig, RunConfig, SamplingConfig, from_options
from .options import common_options, decode_options, prompt_options, sampling_options
from .progress import MODES


@click.command()
@common_options
@decode_options
@click.option("--jobs", "jobs_path", type=click.Path(dir_okay=False), required=True,
              help="JSONL file, one job per line (id, prompt or prompt_file, ...).")
@click.option("--output", type=click.Path(dir_okay=False), required=True,
              help="JSONL results, one line per job in input order.")
@click.option("--resume", is_flag=True,
              help="Keep the results already in --output and run only the missing ids.")
@prompt_options
@sampling_options
@click.option("--progress", "progress_mode", type=click.Choice(MODES),
              default=BatchConfig.default("progress_mode"), show_default=True,
              help="Rank 0's stderr: a live line (bar), periodic lines, or nothing.")
@click.option("--max-batch", callback=lambda ctx, param, value: max_batch_setting(value),
              default=BatchConfig.default("max_batch"), show_default=True,
              help="Jobs of a group decoded together, one batched step for all (1: one job "
                   "after another; auto: 8 on the GPU path, 1 on the CPU path, where one "
                   "job's native decode step is about as fast).")
def batch(**options):
    """Answer many prompts from a JSONL file; shared documents are prefilled once.

    The sampling flags apply to jobs that set none of their own."""
    from .steps import run_spmd

    settings = from_options(options, RunConfig, SamplingConfig, DecodeConfig, BatchConfig)
    sys.exit(run_spmd(batch_command, *settings))


# --max-batch auto where batched steps pay: on the GPU path (every decode step MLX's graph,
# a batched one reads the weights once for all its rows) and where the native step runs
# (its batched form: 8 jobs 2.17x the tokens a second of one at a time, 2 cores,
# docs/BENCHMARKS.md, "Batched decode"). MLX's batched step on the CPU decoded 8 jobs no
# faster than the native step one at a time, and 2 to 4 at half the speed: auto takes 1.
AUTO_MAX_BATCH = 8


def max_batch_setting(value: str) -> str:
    """``--max-batch``'s value checked: "auto" or a whole number >= 1."""
    if value == "auto" or (value.isdigit() and int(value) >= 1):
        return value
    raise click.BadParameter(f"{value!r} is neither auto nor a whole number >= 1")


def choose_max_batch(setting: str, run: RunConfig, loaded, engine) -> tuple[int, str]:
    """(sequences decoded together, why), decided once (collective: auto asks the
    engine's decode plan)."""
    from .steps import compute_of

    if getattr(loaded, "share", None) is not None:
        return 1, "layer-sharded weights decode one sequence at a time"
    if setting != "auto":
        return int(setting), "--max-batch"
    if compute_of(run).gpu:
        return AUTO_MAX_BATCH, "auto: the GPU path's steps are MLX's, batched they read the " \
                               "weights once for all"
    if run.afd is None and engine.batched_native():  # (an FFN rank's engine has no plan)
        return AUTO_MAX_BATCH, "auto: the native step's batched form reads the weights " \
                               "and the document's keys once for all"
    return 1, "auto: MLX's batched steps on the CPU are no faster than one job's native steps"


@contextmanager
def rank0_alone(comm, what: str):
    """While rank 0 reads and tokenizes a group, the other ranks wait in a Bcast: allow
    that wait as long as start-up (a long document, many jobs), not --comm-timeout."""
    from ..runtime.spmd import STARTUP_TIMEOUT_S

    watchdog = getattr(comm, "watchdog", None)
    if watchdog is None:
        yield
        return
    timeout, context = watchdog.timeout, watchdog.context
    watchdog.timeout = max(timeout, STARTUP_TIMEOUT_S) if timeout > 0 else 0
    watchdog.context = what
    try:
        yield
    finally:
        watchdog.timeout, watchdog.context = timeout, context


# -- the command ---------------------------------------------------------------------------
def batch_command(comm, run: RunConfig, sampling: SamplingConfig, decode: DecodeConfig,
                  args: BatchConfig):
    import mlx.core as mx

    from ..run.builder import RunBuilder
    from ..runtime import spmd
    from . import steps

    plan = {}  # rank 0's: the pending jobs stay there

    def check():
        plan.update(validate(run, args))
        return len(plan["pending"])

    if spmd.on_root(comm, check) == 0:
        return
    builder = RunBuilder(comm, run, decode)
    loaded, engine = builder.load(), builder.engine()
    run = builder.run  # settled
    max_batch, why = choose_max_batch(args.max_batch, run, loaded, engine)
    if comm.rank == 0:
        steps.log.info("batch: up to %d jobs decoded together (%s)", max_batch, why)
    cache = engine.new_cache()
    root = BatchRoot(plan, loaded, run, sampling, args, comm.size) if comm.rank == 0 else None
    mx.reset_peak_memory()
    kv_peak = {"bytes": 0, "tokens": 0}
    try:
        while True:
            with rank0_alone(comm, "batch: rank 0 preparing the next jobs"):
                work = spmd.on_root(comm, lambda: root.next_work())
            if work is None:
                break
            run_group(engine, cache, loaded.tokenizer, work, root, kv_peak, max_batch)
        metrics = steps.rank_metrics(comm, cache, steps.model_bytes(engine, loaded),
                                     engine.grid)
        # The cache ends truncated: report its largest size instead.
        peaks = comm.gather_object(kv_peak)
        if root is not None:
            metrics["kv_cache_bytes"] = [p["bytes"] for p in peaks]
            metrics["kv_tokens"] = [p["tokens"] for p in peaks]
    finally:
        if root is not None:
            root.writer.close()
    if root is not None:
        root.finish({**metrics, "max_batch": max_batch}, engine, run.as_json)


def validate(run: RunConfig, args: BatchConfig):
    """Rank 0, before the model loads: the whole jobs file, the outputs, and what the
    output already answers: the pending jobs and how many were done before."""
    from ..errors import UserError
    from ..text_input import check_text
    from .inputs import JOB_LINE_FACTOR, input_bound, read_timeout
    from .jobs import load_finished, read_jobs
    from .outputs import Output, check_outputs, claim_outputs
    from .steps import log, model_inputs, trace_output

    check_text(args.system, "--system")  # before anything is claimed
    if args.resume and run.overwrite:
        raise UserError("give --resume (keep the results) or --overwrite (start over), not both")
    outputs = [Output("--output", args.output, appended=True), trace_output(run)]
    claim_outputs(outputs)  # another run writing the same places is refused at once
    jobs = read_jobs(args.jobs_path,
                     JOB_LINE_FACTOR * input_bound(run.max_context, run.model_path,
                                                   run.memory_limit),
                     read_timeout(run.comm_timeout))
    job_files = [path for job in jobs for path in (job.prompt_file, job.prefix_file) if path]
    check_outputs(outputs,
                  {"the jobs file": [args.jobs_path], "a job's file": job_files,
                   **model_inputs(run)}, run.overwrite)
    finished = load_finished(args.output, args.resume, discard=run.overwrite)
    if finished.dropped_bytes:
        log.warning("dropped a torn last line (%d bytes) from %s", finished.dropped_bytes,
                    args.output)
    known = {job.id for job in jobs}
    unknown = [i for i in finished.ids if i not in known]
    if unknown:
        log.warning("%s answers %d ids that are not in the jobs file (kept): %s", args.output,
                    len(unknown), ", ".join(unknown[:5]))
    done = set(finished.ids)
    pending = [job for job in jobs if job.id not in done]
    log.info("batch: %d jobs, %d already in %s, %d to run", len(jobs), len(jobs) - len(pending),
             args.output, len(pending))
    return {"pending": pending, "already_done": len(jobs) - len(pending)}


def run_group(engine, cache, tokenizer, work, root, kv_peak: dict, max_batch: int):
    """Prefill the group's shared tokens once, then answer its jobs after them (all
    ranks): together, up to ``max_batch`` at a time, or one after another."""
    from ..engine.cache.cache import NO_REWIND

    cache.truncate(0)
    shared = work.shared
    together = max_batch > 1 and len(work.jobs) > 1
    # Each job goes back to the shared tokens (none: to an empty cache, unless the
    # batched decoder moves the job's entries out of it, which counts every layer's).
    cache.rewinds_to = len(shared) if len(shared) or together else NO_REWIND
    shared_s = 0.0
    if len(shared):
        label = f"{work.jobs[0].id} (shared)"
        start = time.perf_counter()
        engine.prefill(cache, shared, progress=root.progress.prefill_callback(label)
                       if root else None)
        shared_s = time.perf_counter() - start
    if together:
        _run_together(engine, cache, tokenizer, work, root, kv_peak, max_batch, shared_s)
        return
    _run_in_turn(engine, cache, tokenizer, work, root, kv_peak, shared_s)


def _run_together(engine, cache, tokenizer, work, root, kv_peak: dict, max_batch: int,
                  shared_s: float):
    """The group's jobs through the scheduler (engine/scheduler.py): batched decode."""
    from ..engine.scheduler import Request, Scheduler

    shared, jobs = work.shared, {job.id: job for job in work.jobs}
    first = work.jobs[0].id

    def finished(request, result, error):
        if root is None:
            return
        job = jobs[request.key]
        if error is not None:
            root.job_failed(job, error)
            return
        reused = len(shared) if request.key != first else 0
        root.job_finished(job, result, reused, shared_s if request.key == first else 0.0,
                          decode_counted=False)

    scheduler = Scheduler(engine, cache, len(shared), tokenizer, max_batch, finished,
                          root.progress.prefill_callback if root else None)
    stats = scheduler.run([Request(job.id, job.ids, job.sampling) for job in work.jobs])
    held = cache.nbytes + stats.tail_bytes  # the document's and every slot's
    if held > kv_peak["bytes"]:
        kv_peak.update(bytes=int(held), tokens=int(cache.positions.size + stats.tail_tokens))
    if root is not None:
        root.decoded_together(stats, scheduler.decoder.kind)


def _run_in_turn(engine, cache, tokenizer, work, root, kv_peak: dict, shared_s: float):
    """The group's jobs one after another, each decoded alone."""
    from ..engine.generation import GenerationFailed, generate

    shared = work.shared
    for index, job in enumerate(work.jobs):
        try:
            result = generate(engine, cache, job.ids, tokenizer, job.sampling,
                              prefill_progress=root.progress.prefill_callback(job.id)
                              if root else None)
        except GenerationFailed as error:
            # Every rank raised it at the same step: the job's error line, the batch goes on.
            cache.truncate(len(shared))
            if root is not None:
                root.job_failed(job, str(error))
            continue
        if cache.nbytes > kv_peak["bytes"]:
            kv_peak.update(bytes=int(cache.nbytes), tokens=int(cache.positions.size))
        cache.truncate(len(shared))
        if root is not None:
            # The first job of a group pays for (and is credited with) the shared prefill.
            reused = len(shared) if index > 0 else 0
            root.job_finished(job, result, reused, shared_s if index == 0 else 0.0)


class BatchRoot:
    """Rank 0's share of a batch: preparing jobs, writing results, showing progress."""

    def __init__(self, plan: dict, loaded, run: RunConfig, sampling: SamplingConfig,
                 args: BatchConfig, ranks: int):
        from .jobs import ResultWriter, group_jobs
        from .prepare import Preparer
        from .progress import Progress
        from .steps import log

        pending = plan["pending"]
        self.preparer = Preparer(loaded, run, sampling, args, ranks)
        self.groups = iter(group_jobs(pending))
        self.writer = ResultWriter(args.output, [job.id for job in pending],
                                   truncate=run.overwrite)
        # --quiet: no live progress unless asked for, and no footer.
        mode = "off" if run.quiet and args.progress_mode == "auto" else args.progress_mode
        self.progress = Progress(len(pending), mode, prefill_chunk=run.prefill_chunk,
                                 prefix=f"[rank 0/{ranks}] ")
        self.progress.attach(log)
        self.footer = not run.quiet
        self.ranks = ranks
        self.already_done = plan["already_done"]
        self.decode_setup_s = 0.0  # decode is readied once, in the first job that decodes
        self.errors = 0
        self.batch_sizes = Counter()  # decode steps run at each batch size
        self.batched_step, self.prompts_as_rows = None, 0  # "native" / "mlx" once together
        self.prompt_tokens = 0
        self.reused_tokens = 0
        self.start = time.perf_counter()

    def next_work(self):
        """The next group with something to run (None: done); writes its error lines."""
        for group in self.groups:
            work, errors = self.preparer.group(group)
            for record in errors:
                self.writer.add(record)
                self.errors += 1
                self.progress.job_done(failed=True)
            if work.jobs:
                return work
        return None

    def job_failed(self, job, message: str):
        from .jobs import error_record

        self.writer.add(error_record(job.id, "generation_failed", message))
        self.errors += 1
        self.progress.job_done(failed=True)

    def job_finished(self, job, result, reused: int, shared_s: float,
                     decode_counted: bool = True):
        """``decode_counted``: the job's decode time counts in the aggregate (False where
        its decode steps were shared with others: ``decoded_together`` counts them)."""
        from .steps import throughput

        prefilled = job.prompt_tokens - reused
        ttft = shared_s + result.prefill_s
        record = {
            "id": job.id,
            "text": result.text,
            "prompt_tokens": job.prompt_tokens,
            "prompt_tokens_prefilled": prefilled,
            "prompt_tokens_reused": reused,
            "prefix_reused": reused > 0,
            "tokens": len(result.tokens),
            "token_ids": [int(t) for t in result.tokens],
            "finish_reason": result.finish_reason,
            "ttft_s": round(ttft, 6),
            "prefill_tok_s": round(prefilled / max(ttft, 1e-9), 3),
            "decode_tok_s": throughput(max(len(result.tokens) - 1, 0), result.decode_s),
        }
        self.writer.add(record)
        self.decode_setup_s += result.decode_setup_s
        self.prompt_tokens += job.prompt_tokens
        self.reused_tokens += reused
        self.progress.job_done(prefilled=prefilled, generated=len(result.tokens),
                               prefill_s=ttft,
                               decode_s=result.decode_s if decode_counted else 0.0)
        if decode_counted and len(result.tokens) > 1:
            self.batch_sizes[1] += len(result.tokens) - 1

    def decoded_together(self, stats, kind: str):
        """A group's batched decode steps: their time, the batch sizes they ran and
        their body ("native" or "mlx")."""
        self.batched_step = kind
        self.progress.decode_s += stats.step_s
        self.batch_sizes.update(stats.sizes)
        self.prompts_as_rows += stats.prompts_as_rows  # jobs whose tails were a step's rows

    def finish(self, metrics: dict, engine, as_json: bool):
        from .steps import algos_used, throughput

        self.progress.close()
        if self.footer:
            sys.stderr.write(self.progress.footer(metrics["peak_mem_bytes"]) + "\n")
            sys.stderr.flush()
        progress = self.progress
        if not as_json:
            return
        summary = {
            "jobs": progress.total_jobs,  # run now; already_done were in the output
            "already_done": self.already_done,
            "answered": progress.jobs_done - self.errors,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_prefilled": progress.prompt_tokens,
            "prompt_tokens_reused": self.reused_tokens,
            "tokens": progress.generated_tokens,
            "elapsed_s": round(time.perf_counter() - self.start, 3),
            "prefill_tok_s": round(progress.prompt_tokens / max(progress.prefill_s, 1e-9), 3),
            "decode_tok_s": throughput(progress.decoded_tokens, progress.decode_s),
            "decode_setup_s": round(self.decode_setup_s, 6),
            "batch_sizes": {str(size): steps for size, steps in sorted(self.batch_sizes.items())},
            "batched_step": self.batched_step,
            "prompts_as_rows": self.prompts_as_rows,
            "ranks": self.ranks,
            **engine.grid.as_dict(),
            "algo": algos_used(engine),
            **engine.decode_modes,
            **metrics,
        }
        sys.stdout.write(json.dumps(summary) + "\n")
        sys.stdout.flush()
