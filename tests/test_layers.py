"""The package's layers hold (docs/ARCHITECTURE.md): every import, module-level or inside
a function, runs from a layer to itself or to a layer below it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "spmd_cp"
# Lowest first; packages in one layer may import each other. The front ends sit on top:
# the HTTP server (server/) under the command line (cli/, whose serve command opens it),
# both over what they share around the engine (run/). errors.py, config.py and
# text_input.py sit under all of them.
LAYER_OF = {name: level for level, names in enumerate(
    [("runtime",), ("kernels",), ("blas",), ("attention",), ("models",), ("engine",), ("run",),
     ("server",), ("cli",)])
    for name in names}
LAYERS = list(LAYER_OF)
BASE = {"errors", "config", "text_input"}


def imported_layers(path: Path):
    """(line, layer name) of every spmd_cp module ``path`` imports."""
    here = path.relative_to(PACKAGE).parts[:-1]  # the packages the module sits in
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] != "spmd_cp":
                    continue
                target = parts[1:]
            else:
                target = list(here[:len(here) - node.level + 1]) + \
                    (node.module.split(".") if node.module else [])
            names = target or [alias.name for alias in node.names]
            for name in names[:1] if target else names:
                yield node.lineno, name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "spmd_cp" and len(parts) > 1:
                    yield node.lineno, parts[1]


def test_imports_run_downward_only():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if len(parts) < 2 or parts[0] not in LAYERS:
            continue  # spmd_cp/__init__, __main__, config, errors: above or beside all
        level = LAYER_OF[parts[0]]
        for line, name in imported_layers(path):
            if name in LAYERS and LAYER_OF[name] > level:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
            elif name not in LAYERS and name not in BASE and name != parts[0]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports "
                              f"spmd_cp.{name}, which is in no layer")
    assert not upward, "\n".join(upward)


def test_the_base_imports_no_layer():
    for name in BASE:
        layers = [n for _, n in imported_layers(PACKAGE / f"{name}.py") if n in LAYERS]
        assert not layers, (name, layers)


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def test_modules_and_functions_stay_small():
    """No module under spmd_cp/ over 400 lines, no function (or method) over 60: a module
    reads as one concern, a function as one step (decorators and docstring included)."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)
