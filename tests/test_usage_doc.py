"""docs/USAGE.md documents every command and every option of the CLI. Pure: walks the click
command tree of ``spmd_cp.cli`` (no MPI, no model) and reads the file."""

from __future__ import annotations

import re
from pathlib import Path

import click

from spmd_cp.cli.commands import cli

USAGE = Path(__file__).resolve().parent.parent / "docs" / "USAGE.md"


def commands(group: click.Group, prefix: str = "spmd-cp"):
    """(path, command) for the group and every command under it, depth first."""
    yield prefix, group
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from commands(command, f"{prefix} {name}")
        else:
            yield f"{prefix} {name}", command


def long_flags(command: click.Command) -> set:
    """Every long flag of the command's options, the help option's included."""
    ctx = click.Context(command, info_name=command.name)
    options = [p for p in command.get_params(ctx) if isinstance(p, click.Option)]
    return {flag for option in options for flag in option.opts + option.secondary_opts
            if flag.startswith("--")}


def documented(text: str, flag: str) -> bool:
    return re.search(re.escape(flag) + r"(?![A-Za-z0-9-])", text) is not None


def test_every_option_is_in_usage_md():
    text = USAGE.read_text()
    missing = sorted(f"{path} {flag}" for path, command in commands(cli)
                     for flag in long_flags(command) if not documented(text, flag))
    assert not missing, f"options missing from {USAGE.name}: {', '.join(missing)}"


def test_every_command_has_a_section():
    text = USAGE.read_text()
    headings = set(re.findall(r"^#+ +`?([a-z-]+)", text, flags=re.MULTILINE))
    missing = sorted(name for name in cli.commands if name not in headings)
    assert not missing, f"commands without a section in {USAGE.name}: {missing}"


def test_the_walk_sees_the_options():
    # A guard for the walk itself: a refactor that hid the options would pass vacuously.
    flags = {path: long_flags(command) for path, command in commands(cli)}
    assert {"--help", "--prompt", "--verbose", "--decode-comm"} <= flags["spmd-cp generate"]
    assert {"--model", "--json", "--recalibrate"} <= flags["spmd-cp doctor"]
    assert "--progress" in flags["spmd-cp batch"]
