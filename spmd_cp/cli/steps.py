"""Steps every command that runs the model shares, on every rank inside the SPMD runtime.

Order inside each command: validate on rank 0 (cheap, before anything heavy: inputs,
outputs, flags), build the run on every rank (run/builder.py: check the model, agreeing
on errors, load it, settle the auto settings, open the engine), tokenize on rank 0 and
broadcast the ids, run the engine, gather per-rank metrics to rank 0, print.
"""

from __future__ import annotations

import logging
import sys

from ..config import RunConfig
from ..engine.engine import Engine
from ..errors import UserError
from ..models.checksum import model_files
from ..models.loader import default_model_path
from ..runtime import spmd
from ..run.builder import compute_of  # noqa: F401 (steps.*)
from ..run.memory import check_memory, cp_ranks, forecast_algo, memory_limit  # noqa: F401
from ..run.metrics import model_bytes, model_nbytes, rank_metrics  # noqa: F401 (steps.*)
from ..run.prompts import cap_to_context, tokenize_checked  # noqa: F401 (steps.*)
from .outputs import Output
from .retired import honour_retired

log = spmd.log


def run_spmd(body, run: RunConfig, *settings) -> int:
    """``body(comm, run, *settings)`` on every rank inside ``spmd.run_main`` (MPI, the
    watchdog, agreement on errors, abort); returns the exit code."""
    def main(comm, _):
        if run.quiet:
            log.setLevel(logging.WARNING)
        body(comm, spmd.everywhere(comm, honour_retired, run, comm.rank == 0), *settings)

    # run_main itself reads only these two settings.
    return spmd.run_main(main, {"verbose": run.verbose, "trace": run.trace})


# -- inputs (rank 0) -------------------------------------------------------------------
def read_prompt(prompt: str | None, prompt_file: str | None, run: RunConfig) -> str:
    """The prompt text from --prompt TEXT, --prompt - (stdin) or --prompt-file F (rank 0;
    ``--prompt-file -`` reads stdin too), read with the bound of cli/inputs.py."""
    if (prompt is None) == (prompt_file is None):
        raise UserError("give exactly one of --prompt TEXT, --prompt - or --prompt-file FILE")
    if prompt_file is not None:
        return read_text_file(prompt_file, "prompt file", run)
    if prompt == "-":
        return read_text_file("-", "prompt", run)
    if not prompt.strip():
        raise UserError("the prompt is empty")
    return prompt


def read_text_file(path: str, what: str, run: RunConfig) -> str:
    """A UTF-8 text input (``-``: standard input), bounded by the model's context."""
    from .inputs import input_bound, read_text, read_timeout

    bound = input_bound(run.max_context, run.model_path, run.memory_limit)
    return read_text(path, what, bound, read_timeout(run.comm_timeout))


def model_inputs(run: RunConfig) -> dict[str, list]:
    """The model's files as inputs an output must not replace (rank 0; never fails: a
    missing model is reported by ``check_model`` with its own message)."""
    path = run.model_path or default_model_path()
    try:
        files = model_files(path)
    except UserError:
        files = []
    return {"the model": [path, *files]}


# -- results ---------------------------------------------------------------------------
def algos_used(engine: Engine) -> str:
    return ",".join(sorted(set(engine.algos_used)))


def throughput(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 3) if tokens and seconds > 0 else 0.0


def write_stdout(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()


def trace_output(run: RunConfig) -> Output:
    return Output("--trace", run.trace)


# -- conversations (rank 0; generate and batch build the same text) --------------------
def new_conversation(system: str | None) -> dict:
    """What a prompt cache remembers of the exchange so far."""
    return {"messages": [{"role": "system", "content": system}] if system else [], "text": ""}


def prompt_text_for(loaded, conversation: dict, prompt: str, chat: bool) -> str:
    """The full text to tokenize: the conversation so far plus the new user prompt."""
    return prompt_parts_for(loaded, conversation, prompt, chat)[0]


def prompt_parts_for(loaded, conversation: dict, prompt: str, chat: bool) -> tuple[str, list]:
    """(the full text to tokenize, where each message's content lies in it)."""
    from ..run.prompts import render

    return render(loaded, conversation, prompt, chat)


def extend_conversation(conversation: dict, prompt: str, answer: str) -> dict:
    messages = conversation["messages"] + [{"role": "user", "content": prompt.strip()},
                                           {"role": "assistant", "content": answer}]
    return {"messages": messages, "text": conversation["text"] + prompt + answer}
