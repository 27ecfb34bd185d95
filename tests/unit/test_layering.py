"""Each folder of the package is one layer, and imports point only down the stack.

A module may import from its own layer and from the layers listed before it; the core never
imports the programs built on it (telemetry's ingester, store and alerts, the dashboard, the
tiering service). The check reads the source (``ast``), so lazy imports inside functions count.
docs/architecture.md draws the same stack.
"""

from __future__ import annotations

import ast
import pathlib
import shutil

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "bytecheckpoint"

# Lowest first. Layers on one line are peers: neither imports the other.
LAYERS: list[set[str]] = [
    {"errors", "_version", "settings"},
    {"storage", "runtime", "data"},
    {"format"},
    {"interop"},
    {"commit"},
    {"state"},
    {"planners"},
    {"planning"},
    {"engine"},
    {"manage"},
    {"api"},
    {"manager"},
    {"tools"},
    {"cli"},
    {"integrations"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# Programs built on the core: it may emit telemetry, never consume it.
FORBIDDEN = ("telemetry.ingest", "telemetry.store", "telemetry.alerts", "dashboard", "storage_tiering")


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "bytecheckpoint" else None


def module_name(path: pathlib.Path, package: pathlib.Path) -> tuple[str, bool]:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def is_module(name: str, package: pathlib.Path) -> bool:
    base = package.parent.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: pathlib.Path, package: pathlib.Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, as absolute names, with the line that imports it."""
    name, is_package = module_name(path, package)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from . import x` imports the submodule x where there is one
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names
                      if is_module(f"{target}.{alias.name}", package)]
    return found


def violations(package: pathlib.Path = PACKAGE) -> list[str]:
    problems = []
    for path in sorted(package.rglob("*.py")):
        name, _ = module_name(path, package)
        own = layer_of(name)
        if own is None:  # bytecheckpoint/__init__.py: the public facade re-exports every layer
            continue
        for line, target in imports_of(path, package):
            where = f"{path.relative_to(package.parent)}:{line}"
            if target.startswith(FORBIDDEN):
                problems.append(f"{where} imports {target}, a program built on the core")
            other = layer_of(target)
            if other is None or other == own:
                continue
            if other not in RANK or own not in RANK:
                missing = other if other not in RANK else own
                problems.append(f"{where}: {missing} is in no layer; add it to LAYERS")
            elif RANK[other] > RANK[own]:
                problems.append(f"{where}: {own} imports {target}, a higher layer")
    return problems


def test_every_import_points_down_the_stack() -> None:
    assert violations() == []


def test_the_check_catches_an_upward_import(tmp_path: pathlib.Path) -> None:
    """A copy of the package with one deliberate upward import fails the check."""
    copy = tmp_path / "bytecheckpoint"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    boxes = copy / "format" / "boxes.py"
    boxes.write_text(boxes.read_text() + "\n\ndef _late() -> None:\n    from ..engine import save  # noqa\n")
    protocol = copy / "commit" / "protocol.py"
    protocol.write_text(protocol.read_text() + "\nimport storage_tiering  # noqa\n")
    found = violations(copy)
    assert any("format/boxes.py" in v and "bytecheckpoint.engine" in v for v in found), found
    assert any("commit/protocol.py" in v and "storage_tiering" in v for v in found), found


@pytest.mark.parametrize("layer", sorted(RANK))
def test_every_layer_exists(layer: str) -> None:
    assert (PACKAGE / layer).is_dir() or (PACKAGE / f"{layer}.py").is_file()
