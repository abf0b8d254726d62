"""Rank 0's side of a batch before the ranks compute: job -> token ids, or the job's error.

A problem with one job (a missing file, an over-long prompt, a forecast over the memory
limit) becomes that job's error line; the batch goes on. Jobs that share a document are
prepared together, and the tokens they all begin with are prefilled once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import BatchConfig, RunConfig, SamplingConfig
from ..errors import UserError
from .jobs import Job, error_record

# A prefix job's prompt is the document, a blank line, then the question: exactly the
# text ``generate --prompt-file`` gets from a file holding "document\n\nquestion".
PREFIX_SEPARATOR = "\n\n"


@dataclass
class PreparedJob:
    """One job as every rank receives it: its own token ids after the group's shared
    ones, its whole prompt's length and its sampling."""

    id: str
    ids: np.ndarray
    prompt_tokens: int
    sampling: SamplingConfig


@dataclass
class GroupWork:
    """A group's work for every rank: the tokens its jobs all begin with (prefilled
    once; empty where they share none) and the jobs."""

    shared: np.ndarray | None
    jobs: list[PreparedJob]


class JobError(Exception):
    """A problem with one job: it becomes that job's error line, the batch goes on."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def read_job_file(path: Path, what: str, bound: int, timeout: float) -> str:
    from .inputs import InputTooLarge, decode_text, read_bounded

    if not path.exists():
        raise JobError("file_not_found", f"{what} not found: {path}")
    try:
        text = decode_text(read_bounded(str(path), what, bound, timeout), what, str(path))
    except InputTooLarge as error:
        raise JobError("prompt_too_long", str(error)) from None
    except UserError as error:
        raise JobError("unreadable_file", str(error)) from None
    if not text.strip():
        raise JobError("empty_prompt", f"{what} is empty: {path}")
    return text


def pick(value, default):
    return default if value is None else value


class Preparer:
    """Rank 0: job -> token ids, or a JobError. Documents are read once per group."""

    def __init__(self, loaded, run: RunConfig, sampling: SamplingConfig, args: BatchConfig,
                 ranks: int):
        from .inputs import context_bound, read_timeout
        from ..run.sharding import weight_plan
        from .steps import cp_ranks, memory_limit, model_nbytes

        self.loaded = loaded
        self.run = run
        self.defaults = sampling
        self.args = args
        self.ranks = cp_ranks(run, ranks)  # the ranks that hold the KV (--afd: attention's)
        self.limit = run.max_context or loaded.max_context
        self.input_bound = context_bound(self.limit, run.memory_limit)
        self.read_timeout = read_timeout(run.comm_timeout)
        self.memory_limit = memory_limit(run)
        self.weights_bytes = weight_plan(loaded, model_nbytes(loaded.model), run.keep_quantized)

    def prompt_of(self, job: Job, documents: dict) -> str:
        if job.prompt_file is not None:
            prompt = read_job_file(job.prompt_file, "prompt file", self.input_bound,
                                   self.read_timeout)
        else:
            prompt = job.prompt
            if not prompt.strip():
                raise JobError("empty_prompt", "the prompt is empty")
        if job.prefix_file is None:
            return prompt
        if job.prefix_file not in documents:
            try:
                documents[job.prefix_file] = read_job_file(job.prefix_file, "prefix file",
                                                           self.input_bound, self.read_timeout)
            except JobError as error:
                documents[job.prefix_file] = error
        document = documents[job.prefix_file]
        if isinstance(document, JobError):
            raise document
        return document.strip() + PREFIX_SEPARATOR + prompt

    def token_ids(self, job: Job, documents: dict):
        import numpy as np

        from ..engine.cache.forecast import check_fits
        from ..engine.model import kv_model_shape
        from ..engine.weights.tensor_groups import tensor_share
        from ..config import sampling_problem
        from ..engine.generation import token_sampler
        from ..runtime.resident import outside_mlx_bytes
        from .steps import compute_of, forecast_algo, new_conversation, prompt_parts_for
        from ..run.prompts import encode

        # The same text generate builds (chat template, stripped user turn), the user's
        # text tokenized as plain text as generate does.
        text, spans = prompt_parts_for(
            self.loaded, new_conversation(pick(job.system, self.args.system)),
            self.prompt_of(job, documents), not self.args.no_chat_template)
        problem = sampling_problem(self.sampling(job), self.loaded.config.get("vocab_size"))
        if problem:
            raise JobError("invalid_job", problem)
        try:
            # The sampler's own checks, now rather than in the middle of the ranks' work.
            token_sampler(self.sampling(job))
        except (ValueError, TypeError, OverflowError) as error:
            raise JobError("invalid_job", f"sampling settings refused: {error}") from None
        ids = np.asarray(encode(self.loaded, text, spans, self.run.parse_special), np.int64)
        if ids.size == 0:
            raise JobError("empty_prompt", "the prompt is empty after tokenization")
        if self.limit is not None and ids.size > self.limit:
            raise JobError("prompt_too_long",
                           f"prompt has {ids.size} tokens, more than --max-context {self.limit}")
        # The memory forecast generate checks, per job: one huge job must not take the
        # whole batch down with it.
        try:
            shape = kv_model_shape(self.loaded, self.run.kv_dtype, compute_of(self.run))
            check_fits(tensor_share(shape, self.run.tp), self.weights_bytes,
                       int(ids.size) + self.sampling(job, int(ids.size)).max_tokens,
                       min(self.run.prefill_chunk or int(ids.size), int(ids.size)), self.ranks,
                       self.memory_limit, forecast_algo(self.run),
                       process_bytes=outside_mlx_bytes())
        except UserError as error:
            raise JobError("out_of_memory", str(error)) from None
        return ids

    def sampling(self, job: Job, prompt_tokens: int = 0) -> SamplingConfig:
        """The job's own settings, the flags' for those it leaves out; at most as many
        tokens to generate as fit the context after ``prompt_tokens``."""
        from .steps import cap_to_context

        d = self.defaults
        max_tokens = pick(job.max_tokens, d.max_tokens)
        if prompt_tokens:
            max_tokens = cap_to_context(max_tokens, prompt_tokens, self.limit)
        return SamplingConfig(max_tokens=max_tokens,
                              temp=pick(job.temperature, d.temp), top_p=pick(job.top_p, d.top_p),
                              top_k=pick(job.top_k, d.top_k), min_p=pick(job.min_p, d.min_p),
                              seed=job.seed, stop=list(job.stop),
                              ignore_eos=pick(job.ignore_eos, d.ignore_eos))

    def group(self, jobs: list[Job]) -> tuple[GroupWork, list[dict]]:
        """(work for every rank, error records) for one group of jobs."""
        from ..engine.cache.prompt_cache import common_prefix_length

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
        work = GroupWork(ready[0][1][:shared] if ready else None,
                         [PreparedJob(job.id, ids[shared:], int(len(ids)),
                                      self.sampling(job, int(len(ids))))
                          for job, ids in ready])
        return work, errors
