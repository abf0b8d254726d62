"""spmd-cp batch: answer every job of a JSONL file; a shared document is prefilled once.

    mpiexec -n 2 spmd-cp batch --jobs jobs.jsonl --output results.jsonl [--resume]

Order of work, on every rank: rank 0 checks the whole jobs file and the output file
(nothing heavy yet), every rank loads the model, then group by group rank 0 reads and
tokenizes the jobs and broadcasts their ids, and all ranks prefill and decode together.
Jobs that share a ``prefix_file`` (and ``system``) run back to back: the tokens they all
begin with (chat header + document) are prefilled once into the sharded cache, each job
prefills only its own tail after them (a short tail on a long cached context is the
case pass-Q exists for; ``--cp-algo auto`` weighs it, DESIGN.md section 2) and generates,
and the cache is truncated back to the shared part.
Results are written in input order (jobs.ResultWriter holds early finishers). See
docs/BATCH.md.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import click

from .options import common_options, decode_options
from ..errors import UserError
from .jobs import Job, ResultWriter, error_record, group_jobs, load_finished, read_jobs
from .progress import MODES, Progress

# A prefix job's prompt is the document, a blank line, then the question: exactly the
# text ``generate --prompt-file`` gets from a file holding "document\n\nquestion".
PREFIX_SEPARATOR = "\n\n"


@click.command()
@common_options
@decode_options
@click.option("--jobs", "jobs_path", type=click.Path(dir_okay=False), required=True,
              help="JSONL file, one job per line (id, prompt or prompt_file, ...).")
@click.option("--output", type=click.Path(dir_okay=False), required=True,
              help="JSONL results, one line per job in input order.")
@click.option("--resume", is_flag=True,
              help="Keep the results already in --output and run only the missing ids.")
@click.option("--system", default=None, help="System message for jobs that set none.")
@click.option("--no-chat-template", is_flag=True, help="Feed prompts as they are.")
@click.option("--max-tokens", type=click.IntRange(min=0), default=256, show_default=True,
              help="For jobs without max_tokens.")
@click.option("--temp", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="For jobs without temperature (0 = greedy).")
@click.option("--top-p", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="For jobs without top_p.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
              help="For jobs without top_k.")
@click.option("--progress", "progress_mode", type=click.Choice(MODES), default="auto",
              show_default=True,
              help="Rank 0's stderr: a live line (bar), periodic lines, or nothing.")
def batch(**options):
    """Answer many prompts from a JSONL file; shared documents are prefilled once."""
    sys.exit(run_batch(options))


def run_batch(options: dict) -> int:
    from ..runtime import spmd

    # MPI, the communicator and its watchdog, exactly as for generate (commands.run_command).
    return spmd.run_main(batch_command, options)


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


# -- prompts ---------------------------------------------------------------------------
class JobError(Exception):
    """A problem with one job: it becomes that job's error line, the batch goes on."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def read_job_file(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobError("file_not_found", f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise JobError("unreadable_file", f"cannot read {what} {path}: {error}") from None
    if not text.strip():
        raise JobError("empty_prompt", f"{what} is empty: {path}")
    return text


class Preparer:
    """Rank 0: job -> token ids, or a JobError. Documents are read once per group."""

    def __init__(self, loaded, options: dict, ranks: int, memory_limit: int):
        from .commands import model_nbytes

        self.loaded = loaded
        self.options = options
        self.ranks = ranks
        self.limit = options["max_context"] or loaded.max_context
        self.memory_limit = memory_limit
        self.weights_bytes = model_nbytes(loaded.model)

    def prompt_of(self, job: Job, documents: dict) -> str:
        if job.prompt_file is not None:
            prompt = read_job_file(job.prompt_file, "prompt file")
        else:
            prompt = job.prompt
            if not prompt.strip():
                raise JobError("empty_prompt", "the prompt is empty")
        if job.prefix_file is None:
            return prompt
        if job.prefix_file not in documents:
            try:
                documents[job.prefix_file] = read_job_file(job.prefix_file, "prefix file")
            except JobError as error:
                documents[job.prefix_file] = error
        document = documents[job.prefix_file]
        if isinstance(document, JobError):
            raise document
        return document.strip() + PREFIX_SEPARATOR + prompt

    def token_ids(self, job: Job, documents: dict):
        import numpy as np

        from .commands import new_conversation, prompt_text_for
        from ..engine.forecast import check_fits

        system = job.system if job.system is not None else self.options["system"]
        # The same text generate builds (chat template, stripped user turn).
        text = prompt_text_for(self.loaded, new_conversation(system),
                               self.prompt_of(job, documents),
                               not self.options["no_chat_template"])
        ids = np.asarray(self.loaded.tokenizer.encode(text), np.int64)
        if ids.size == 0:
            raise JobError("empty_prompt", "the prompt is empty after tokenization")
        if self.limit is not None and ids.size > self.limit:
            raise JobError("prompt_too_long",
                           f"prompt has {ids.size} tokens, more than --max-context {self.limit}")
        # The memory forecast generate checks, per job: one huge job must not take the
        # whole batch down with it.
        algo = "pass-kv" if self.options["cp_algo"] == "auto" else self.options["cp_algo"]
        try:
            check_fits(self.loaded.shape, self.weights_bytes,
                       int(ids.size) + self.sampling(job).max_tokens,
                       self.options["prefill_chunk"] or int(ids.size), self.ranks,
                       self.memory_limit, algo)
        except UserError as error:
            raise JobError("out_of_memory", str(error)) from None
        return ids

    def sampling(self, job: Job):
        from ..engine.generation import SamplingOptions

        def pick(value, default):
            return default if value is None else value

        return SamplingOptions(max_tokens=pick(job.max_tokens, self.options["max_tokens"]),
                               temp=pick(job.temperature, self.options["temp"]),
                               top_p=pick(job.top_p, self.options["top_p"]),
                               top_k=pick(job.top_k, self.options["top_k"]),
                               seed=job.seed, stop=list(job.stop))

    def group(self, jobs: list[Job]):
        """(work for every rank, error records) for one group of jobs."""
        from ..engine.prompt_cache import common_prefix_length

        documents, ready, errors = {}, [], []
        for job in jobs:
            try:
                ready.append((job, self.token_ids(job, documents)))
            except JobError as error:
                errors.append(error_record(job.id, error.kind, error.message))
        shared = 0
        if len(ready) >= 2 and jobs[0].group_key is not None:
            # The longest run of tokens every job starts with, found on token ids (not
            # text): BPE may merge across the end of the document. Each job keeps at
            # least one token of its own, which yields its first logits.
            first = ready[0][1]
            shared = min([len(first) - 1] + [common_prefix_length(first, ids)
                                             for _, ids in ready[1:]])
        work = {"shared": ready[0][1][:shared] if ready else None,
                "jobs": [{"id": job.id, "ids": ids[shared:], "prompt_tokens": int(len(ids)),
                          "sampling": self.sampling(job)} for job, ids in ready]}
        return work, errors


# -- the command ---------------------------------------------------------------------------
def batch_command(comm, options: dict):
    import mlx.core as mx

    from ..runtime import spmd
    from .commands import check_writable, make_engine, model_nbytes, rank_metrics, resolve_model
    from ..engine.forecast import default_memory_limit, parse_bytes

    log = spmd.log
    plan = {}

    def validate():
        plan["memory_limit"] = (parse_bytes(options["memory_limit"])
                                if options.get("memory_limit") else default_memory_limit())
        jobs = read_jobs(options["jobs_path"])
        output = Path(options["output"])
        check_writable(options["output"])
        if output.exists() and output.resolve() == Path(options["jobs_path"]).resolve():
            raise UserError(f"--output is the jobs file: {output}")
        finished = load_finished(output, options["resume"])
        if finished.dropped_bytes:
            log.warning("dropped a torn last line (%d bytes) from %s", finished.dropped_bytes,
                        output)
        known = {job.id for job in jobs}
        unknown = [i for i in finished.ids if i not in known]
        if unknown:
            log.warning("%s answers %d ids that are not in the jobs file (kept): %s", output,
                        len(unknown), ", ".join(unknown[:5]))
        done = set(finished.ids)
        plan["pending"] = [job for job in jobs if job.id not in done]
        plan["already_done"] = len(jobs) - len(plan["pending"])
        log.info("batch: %d jobs, %d already in %s, %d to run", len(jobs),
                 len(jobs) - len(plan["pending"]), output, len(plan["pending"]))
        return len(plan["pending"])

    pending_count = spmd.on_root(comm, validate)
    if pending_count == 0:
        return
    loaded = resolve_model(comm, options)
    engine = make_engine(comm, loaded, options)
    cache = engine.new_cache()
    root = None
    if comm.rank == 0:
        root = RootSide(plan, loaded, options, comm.size)
        root.progress.attach(log)
    mx.reset_peak_memory()
    kv_peak = {"bytes": 0, "tokens": 0}
    try:
        while True:
            with rank0_alone(comm, "batch: rank 0 preparing the next jobs"):
                work = spmd.on_root(comm, lambda: root.next_work())
            if work is None:
                break
            run_group(engine, cache, loaded.tokenizer, work, root, kv_peak)
        metrics = rank_metrics(comm, cache, model_nbytes(loaded.model))
        # The cache ends truncated: report its largest size instead.
        peaks = comm.gather_object(kv_peak)
        if root is not None:
            metrics["kv_cache_bytes"] = [p["bytes"] for p in peaks]
            metrics["kv_tokens"] = [p["tokens"] for p in peaks]
    finally:
        if root is not None:
            root.writer.close()
    if root is not None:
        root.finish(metrics, engine, options["as_json"])


def run_group(engine, cache, tokenizer, work: dict, root, kv_peak: dict):
    """Prefill the group's shared tokens once, then answer each job after them (all ranks)."""
    from ..engine.generation import generate

    cache.truncate(0)
    shared = work["shared"]
    shared_s = 0.0
    if len(shared):
        label = f"{work['jobs'][0]['id']} (shared)"
        start = time.perf_counter()
        engine.prefill(cache, shared, progress=root.progress.prefill_callback(label)
                       if root else None)
        shared_s = time.perf_counter() - start
    for index, job in enumerate(work["jobs"]):
        result = generate(engine, cache, job["ids"], tokenizer, job["sampling"],
                          prefill_progress=root.progress.prefill_callback(job["id"])
                          if root else None)
        if cache.nbytes > kv_peak["bytes"]:
            kv_peak.update(bytes=int(cache.nbytes), tokens=int(cache.positions.size))
        cache.truncate(len(shared))
        if root is not None:
            # The first job of a group pays for (and is credited with) the shared prefill.
            reused = len(shared) if index > 0 else 0
            root.job_finished(job, result, reused, shared_s if index == 0 else 0.0)


class RootSide:
    """Rank 0's share of a batch: preparing jobs, writing results, showing progress."""

    def __init__(self, plan: dict, loaded, options: dict, ranks: int):
        pending = plan["pending"]
        self.preparer = Preparer(loaded, options, ranks, plan["memory_limit"])
        self.groups = iter(group_jobs(pending))
        self.writer = ResultWriter(options["output"], [job.id for job in pending])
        self.progress = Progress(len(pending), options["progress_mode"],
                                 prefill_chunk=options["prefill_chunk"],
                                 prefix=f"[rank 0/{ranks}] ")
        self.ranks = ranks
        self.already_done = plan["already_done"]
        self.errors = 0
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
            if work["jobs"]:
                return work
        return None

    def job_finished(self, job: dict, result, reused: int, shared_s: float):
        prefilled = job["prompt_tokens"] - reused
        ttft = shared_s + result.prefill_s
        decoded = max(len(result.tokens) - 1, 0)
        record = {
            "id": job["id"],
            "text": result.text,
            "prompt_tokens": job["prompt_tokens"],
            "prompt_tokens_prefilled": prefilled,
            "prompt_tokens_reused": reused,
            "prefix_reused": reused > 0,
            "tokens": len(result.tokens),
            "finish_reason": result.finish_reason,
            "ttft_s": round(ttft, 6),
            "prefill_tok_s": round(prefilled / max(ttft, 1e-9), 3),
            "decode_tok_s": round(decoded / result.decode_s, 3)
            if decoded and result.decode_s > 0 else 0.0,
        }
        self.writer.add(record)
        self.prompt_tokens += job["prompt_tokens"]
        self.reused_tokens += reused
        self.progress.job_done(prefilled=prefilled, generated=len(result.tokens),
                               prefill_s=ttft, decode_s=result.decode_s)

    def finish(self, metrics: dict, engine, as_json: bool):
        self.progress.close()
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
            "decode_tok_s": round(progress.decoded_tokens / progress.decode_s, 3)
            if progress.decode_s > 0 else 0.0,
            "ranks": self.ranks,
            "algo": ",".join(sorted(set(engine.algos_used))),
            **metrics,
        }
        sys.stdout.write(json.dumps(summary) + "\n")
        sys.stdout.flush()
