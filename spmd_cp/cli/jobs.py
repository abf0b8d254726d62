"""Batch jobs: the JSONL jobs file in, the JSONL results file out, resume after a crash.

Plain file handling, no MLX and no MPI: rank 0 alone calls these. The whole jobs file is
checked before the model loads, and every bad line is named at once, because a batch
that dies on line 9,000 after an hour of work is the expensive way to find a typo.
Results are appended one line per job, each flushed and fsync'ed, so a killed run loses
at most the line being written; ``--resume`` drops that torn line and runs what is missing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..config import describe_range, in_range
from ..errors import UserError
from ..text_input import find_invalid_text

# Bad lines spelled out in the error message; the line numbers are always all listed.
MAX_DETAILED_LINES = 10


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_stop(value) -> bool:
    return isinstance(value, str) or (isinstance(value, list)
                                      and all(isinstance(s, str) for s in value))


def _sampling(setting: str, integer: bool = False):
    """(check, what the value must be) of a sampling key, from config.SAMPLING_RANGES."""
    is_type = _is_int if integer else _is_number
    kind = "an integer" if integer else "a number"
    return (lambda v: is_type(v) and in_range(setting, v),
            f"{kind} {describe_range(setting)}")


# key -> (check, what the value must be). ``None`` values count as absent.
FIELDS = {
    "id": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "prompt": (lambda v: isinstance(v, str), "a string"),
    "prompt_file": (lambda v: isinstance(v, str) and v != "", "a file path string"),
    "prefix_file": (lambda v: isinstance(v, str) and v != "", "a file path string"),
    "system": (lambda v: isinstance(v, str), "a string"),
    "max_tokens": _sampling("max_tokens", integer=True),
    "temperature": _sampling("temp"),
    "top_p": _sampling("top_p"),
    "top_k": _sampling("top_k", integer=True),
    "min_p": _sampling("min_p"),
    "seed": _sampling("seed", integer=True),
    "stop": (_check_stop, "a string or a list of strings"),
    "ignore_eos": (lambda v: isinstance(v, bool), "true or false"),
}


@dataclass(frozen=True)
class Job:
    """One validated input line; file paths are resolved against the jobs file's folder."""

    line: int
    id: str
    prompt: str | None = None
    prompt_file: Path | None = None
    prefix_file: Path | None = None
    system: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool | None = None

    @property
    def group_key(self):
        """Jobs with equal keys share a prefilled document (None: nothing to share)."""
        return None if self.prefix_file is None else (str(self.prefix_file), self.system)


def _line_problems(record) -> list[str]:
    if not isinstance(record, dict):
        return [f"not a JSON object but {type(record).__name__}"]
    problems = [f"unknown key {key!r}" for key in record if key not in FIELDS]
    for key, (check, must_be) in FIELDS.items():
        value = record.get(key)
        if value is None:
            if key == "id":
                problems.append("missing 'id'")
        elif not check(value):
            problems.append(f"{key!r} must be {must_be}, got {json.dumps(value)[:40]}")
    for key, value in record.items():
        invalid = find_invalid_text(value) if key in FIELDS else None
        if invalid is not None:  # the rule for all text: spmd_cp/text_input.py
            problems.append(f"{key!r} is not valid Unicode text ({invalid[1]})")
    has_prompt = record.get("prompt") is not None
    has_file = record.get("prompt_file") is not None
    if has_prompt == has_file:
        problems.append("give exactly one of 'prompt' or 'prompt_file'")
    return problems


def read_jobs(path: str | os.PathLike, line_bound: int | None = None,
              timeout: float = 0) -> list[Job]:
    """Every job of a JSONL jobs file, or one UserError naming every bad line.

    Blank lines are skipped; line numbers count them. Each line holds at most
    ``line_bound`` bytes, the file at most ``inputs.JOBS_FILE_BYTES`` (cli/inputs.py).
    """
    from .inputs import JOBS_FILE_BYTES, decode_text, read_bounded

    path = Path(path)
    data = read_bounded(str(path), "jobs file", JOBS_FILE_BYTES, timeout, line_bound,
                        hint="split the file, or give a long prompt as a prompt_file")
    text = decode_text(data, "jobs file", str(path))
    base = path.resolve().parent
    jobs, bad, first_line_of = [], [], {}
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError as error:
            bad.append((number, f"invalid JSON ({error.msg} at column {error.colno})"))
            continue
        problems = _line_problems(record)
        job_id = record.get("id") if isinstance(record, dict) else None
        if isinstance(job_id, str) and job_id:
            if job_id in first_line_of:
                problems.append(f"duplicate id {job_id!r} (first on line {first_line_of[job_id]})")
            else:
                first_line_of[job_id] = number
        if problems:
            bad.append((number, "; ".join(problems)))
            continue
        jobs.append(_make_job(number, record, base))
    if bad:
        raise UserError(_bad_lines_message(f"jobs file {path}", bad))
    if not jobs:
        raise UserError(f"jobs file has no jobs: {path}")
    return jobs


def _make_job(number: int, record: dict, base: Path) -> Job:
    def resolve(key):
        value = record.get(key)
        return None if value is None else (base / Path(value).expanduser()).resolve()

    stop = record.get("stop") or ()
    return Job(line=number, id=record["id"], prompt=record.get("prompt"),
               prompt_file=resolve("prompt_file"), prefix_file=resolve("prefix_file"),
               system=record.get("system"), max_tokens=record.get("max_tokens"),
               temperature=record.get("temperature"), top_p=record.get("top_p"),
               top_k=record.get("top_k"), min_p=record.get("min_p"), seed=record.get("seed"),
               stop=(stop,) if isinstance(stop, str) else tuple(stop),
               ignore_eos=record.get("ignore_eos"))


def _bad_lines_message(what: str, bad: list) -> str:
    numbers = ", ".join(str(number) for number, _ in bad)
    details = "; ".join(f"line {number}: {problem}" for number, problem in bad[:MAX_DETAILED_LINES])
    more = f"; ... {len(bad) - MAX_DETAILED_LINES} more" if len(bad) > MAX_DETAILED_LINES else ""
    plural = "s" if len(bad) > 1 else ""
    return f"{what}: bad line{plural} {numbers}: {details}{more}"


# -- the results file ------------------------------------------------------------------
@dataclass
class Finished:
    """What an existing results file already holds (after dropping a torn last line)."""

    ids: list[str]
    dropped_bytes: int = 0


def load_finished(path: str | os.PathLike, resume: bool, discard: bool = False) -> Finished:
    """The ids already answered in ``path``; with ``resume``, drop a torn last line.

    A torn last line is one without its newline, or an invalid last line: what a kill
    in the middle of a write leaves. A bad line anywhere else is refused, by number.
    Without ``resume``, any non-empty existing file is refused, unless ``discard``
    (--overwrite: the ResultWriter starts it over).
    """
    path = Path(path)
    if discard or not path.exists() or path.stat().st_size == 0:
        return Finished([])
    if not resume:
        raise UserError(f"output {path} exists; use --resume or remove it")
    data = path.read_bytes()
    *complete, tail = data.split(b"\n")
    keep = len(data) - len(tail)  # bytes up to the last newline
    ids, seen = [], {}
    for number, raw in enumerate(complete, 1):
        if not raw.strip():
            continue
        job_id = _result_id(raw)
        if job_id is None:
            if number == len(complete) and not tail:
                keep -= len(raw) + 1  # the last line is torn even though it ended
                break
            raise UserError(f"output {path} line {number} is not a result line "
                            "(JSON with 'id' and 'text' or 'error'); fix or remove it")
        if job_id in seen:
            raise UserError(f"output {path} lines {seen[job_id]} and {number} both answer "
                            f"id {job_id!r}; remove one")
        seen[job_id] = number
        ids.append(job_id)
    dropped = len(data) - keep
    if dropped:
        with open(path, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return Finished(ids, dropped)


def _result_id(raw: bytes) -> str | None:
    try:
        record = json.loads(raw)
    except ValueError:  # includes invalid UTF-8
        return None
    if (not isinstance(record, dict) or not isinstance(record.get("id"), str)
            or ("text" not in record and "error" not in record)):
        return None
    return record["id"]


class ResultWriter:
    """Appends result lines in input order, each flushed and fsync'ed as soon as it can be.

    Jobs may finish out of input order (shared-document groups run together); a result
    is held until every earlier job's result is written, so the file is always an
    input-order prefix of the pending jobs and ``--resume`` needs no reordering.
    """

    def __init__(self, path: str | os.PathLike, order: list[str], truncate: bool = False):
        self.order = list(order)
        self.next = 0
        self.held: dict[str, dict] = {}
        self.file = open(path, "wb" if truncate else "ab")

    def add(self, record: dict) -> int:
        """Queue ``record`` (it has ``id``); write what is ready. Returns lines written."""
        job_id = record["id"]
        if job_id in self.held or job_id not in self.order[self.next:]:
            raise ValueError(f"unexpected or repeated result for id {job_id!r}")
        self.held[job_id] = record
        written = 0
        while self.next < len(self.order) and self.order[self.next] in self.held:
            line = json.dumps(self.held.pop(self.order[self.next]), ensure_ascii=False)
            self.file.write(line.encode("utf-8") + b"\n")
            self.file.flush()
            os.fsync(self.file.fileno())
            self.next += 1
            written += 1
        return written

    def close(self):
        self.file.close()


def error_record(job_id: str, kind: str, message: str) -> dict:
    return {"id": job_id, "error": {"type": kind, "message": message}}


def group_jobs(jobs: list[Job]) -> list[list[Job]]:
    """Execution order: jobs sharing a document run back to back, at the position of the
    group's first job; everything else keeps its input order."""
    groups, by_key = [], {}
    for job in jobs:
        key = job.group_key
        if key is None:
            groups.append([job])
        elif key in by_key:
            by_key[key].append(job)
        else:
            by_key[key] = [job]
            groups.append(by_key[key])
    return groups
