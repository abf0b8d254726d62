"""Nothing a user can run or read about goes undocumented. Pure and fast: walks the click
command tree of ``spmd_cp.cli`` in-process (no MPI, no model) and reads the docs.

- Every command has a section in docs/USAGE.md, and every visible option of a command
  appears in the sections whose heading names that command (``## serve``, ``## Options of
  generate, score, batch and serve``, ...). Hidden options (test-only) stay out of it.
- Every result file in benchmarks/results is cited by README.md or a page of docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

import click

from spmd_cp.cli.commands import cli

ROOT = Path(__file__).resolve().parent.parent
USAGE = ROOT / "docs" / "USAGE.md"
RESULTS = ROOT / "benchmarks" / "results"
HEADING = re.compile(r"^(#+) +(.*)$", flags=re.MULTILINE)


def commands(group: click.Group, prefix: str = "spmd-cp"):
    """(path, command) for every command under the group, depth first."""
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from commands(command, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", command


def long_flags(command: click.Command, hidden: bool = False) -> set:
    """The long flags of the command's visible options (hidden=True: of its hidden ones);
    --help is every command's and documented once, not per command."""
    ctx = click.Context(command, info_name=command.name)
    options = [p for p in command.get_params(ctx)
               if isinstance(p, click.Option) and p.hidden == hidden]
    return {flag for option in options for flag in option.opts + option.secondary_opts
            if flag.startswith("--") and flag != "--help"}


def mentions(text: str, word: str) -> bool:
    """``word`` in ``text`` as a whole flag or name (``--top-k`` is not ``--top-k-max``)."""
    return re.search(r"(?<![\w-])" + re.escape(word) + r"(?![\w-])", text) is not None


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) of every section of a markdown text, each up to the next heading."""
    heads = list(HEADING.finditer(text))
    return [(head.group(0), text[head.end():heads[i + 1].start() if i + 1 < len(heads)
                                  else len(text)]) for i, head in enumerate(heads)]


def sections_of(text: str, name: str) -> list[tuple[str, str]]:
    """The sections whose heading names the command."""
    return [(heading, body) for heading, body in sections(text)
            if mentions(HEADING.match(heading).group(2), name)]


def test_every_command_has_a_section_in_usage_md():
    text = USAGE.read_text()
    missing = sorted(path for path, command in commands(cli)
                     if not sections_of(text, command.name))
    assert not missing, (f"commands without a section in docs/{USAGE.name} (a heading that "
                         f"names the command, e.g. '## serve'): {', '.join(missing)}")


def test_every_visible_option_is_in_its_commands_sections():
    text = USAGE.read_text()
    missing = []
    for path, command in commands(cli):
        own = sections_of(text, command.name)
        body = "\n".join(heading + body for heading, body in own)
        headings = "; ".join(heading for heading, _ in own) or "none"
        missing += [f"{path} {flag} (sections read: {headings})"
                    for flag in sorted(long_flags(command)) if not mentions(body, flag)]
    assert not missing, (f"options not documented in docs/{USAGE.name}'s sections for their "
                         "command; add each to a table there:\n" + "\n".join(missing))


def test_help_is_documented_once():
    assert mentions(USAGE.read_text(), "--help")


def test_hidden_options_stay_out_of_usage_md():
    text = USAGE.read_text()
    shown = sorted({flag for _, command in commands(cli) for flag in long_flags(command, True)
                    if mentions(text, flag)})
    assert not shown, f"hidden (test-only) options in docs/{USAGE.name}: {', '.join(shown)}"


def cited(stem: str, docs: str) -> bool:
    """A result file's citation: ``results/NAME``, ``NAME.json``/``.md``/``.{json,md}``
    or ``NAME`` in backticks (the result-file columns of the tables)."""
    name = re.escape(stem)
    return re.search(rf"results/{name}(?![\w-])|(?<![\w/-]){name}\.(json|md|\{{)|`{name}`",
                     docs) is not None


def test_every_result_file_is_cited_by_a_doc():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    docs = "\n".join(page.read_text() for page in pages)
    files = sorted(p for p in RESULTS.iterdir() if p.is_file())
    uncited = [f"benchmarks/results/{p.name}" for p in files if not cited(p.stem, docs)]
    assert not uncited, ("result files no doc cites (name each in README.md or docs/*.md, "
                         "as `NAME`, NAME.json or benchmarks/results/NAME.md, with its "
                         "machine, date and figure):\n" + "\n".join(uncited))


def test_the_walks_see_what_they_check():
    # Guards for the walks themselves: a refactor that hid the options or emptied the
    # results folder would pass the checks above vacuously.
    flags = {path: long_flags(command) for path, command in commands(cli)}
    assert {"--prompt", "--verbose", "--decode-comm"} <= flags["spmd-cp generate"]
    assert {"--model", "--json", "--recalibrate"} <= flags["spmd-cp doctor"]
    assert {"--port", "--json", "--api-key"} <= flags["spmd-cp serve"]
    assert "--progress" in flags["spmd-cp batch"]
    assert "--fault" in long_flags(cli.commands["generate"], hidden=True)
    assert "--fault" not in flags["spmd-cp generate"]
    text = USAGE.read_text()
    assert [h for h, _ in sections_of(text, "serve")] == [
        "## Options of generate, score, batch and serve", "## serve"]
    assert len(list(RESULTS.glob("*.json"))) >= 30
    assert cited("vs_mlx_lm", "result file `vs_mlx_lm`")
    assert cited("gpu_check_h100", "benchmarks/results/gpu_check_h100.{json,md}")
    assert not cited("vs_llamacpp", "`vs_llamacpp_default`, vs_llamacpp_n2_3k.md")


# A directory of one machine: a home, a working copy, a venv or scratch folder under /tmp
# (also the state spmd-cp's launchers write there: docs name it under $TMPDIR). The GPU
# machine's prepared setup (/tmp/gpu, benchmarks/gpu/README.md) is what a reader meets.
MACHINE_PATH = re.compile(r"(?<![\w.$-])/(?:work|root|home|Users)/[\w.-]+"
                          r"|/tmp/(?!gpu/|gpu\b)[\w.-]+")


def test_no_result_file_or_doc_names_a_directory_of_one_machine():
    """Commands and outputs as a reader can rerun and meet them: relative paths, or the
    places spmd-cp itself writes."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted(p for p in RESULTS.iterdir() if p.suffix in (".json", ".md"))]
    found = [f"{page.relative_to(ROOT)}:{number}: {match.group(0)}"
             for page in pages
             for number, line in enumerate(page.read_text().splitlines(), 1)
             for match in [MACHINE_PATH.search(line)] if match]
    assert len(pages) > 20  # the walk saw the pages
    assert not found, "paths of one machine (give the command as a user would run it):\n" + \
        "\n".join(found)
