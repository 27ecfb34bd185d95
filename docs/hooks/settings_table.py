"""MkDocs hook: the settings reference, rendered from every package's settings registry at build time.

``docs/operations.md`` holds the marker below; every build replaces it with one table per
registry: each package declares the variables it reads in its own ``settings`` module
(``bytecheckpoint/settings.py`` has the machinery and the library's own), so the page cannot drift
from them, and ``tests/unit/test_settings_registry.py`` checks them against the source.

The settings modules are loaded from their files, not through their packages: a package's
``__init__`` may import torch (``storage_tiering`` does), its settings module must not.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import Any

MARKER = "<!-- settings-reference -->"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Each package's registry, in page order. A package that reads a new variable declares it in its
# own module; a new package with settings adds its module here.
MODULES = (
    "bytecheckpoint/settings.py",
    "telemetry/settings.py",
    "dashboard/settings.py",
    "storage_tiering/settings.py",
    "tests/support/settings.py",
)
# Names of variables inside the registry's prose, set in code type on the page.
_NAME = re.compile(r"\b(?:BCP|AWS)_[A-Z0-9_]*[A-Z0-9]\b|\bLOCAL_WORLD_SIZE\b")


def _load(rel: str) -> ModuleType:
    path = os.path.join(REPO, rel)
    if not os.path.exists(path):
        raise RuntimeError(f"the settings registry {rel} is gone: point MODULES in "
                           "docs/hooks/settings_table.py at its new place")
    if rel == "bytecheckpoint/settings.py":  # the machinery: one copy, so Setting is one class
        import bytecheckpoint.settings

        return bytecheckpoint.settings
    name = "_bcp_settings_" + rel.removesuffix(".py").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while a class is built
    spec.loader.exec_module(module)
    return module


def sources() -> tuple[tuple[str, Any], ...]:
    """``(module path, REGISTRY)`` of every package, in page order."""
    if REPO not in sys.path:  # `mkdocs build` from elsewhere still finds the library
        sys.path.insert(0, REPO)
    return tuple((rel, _load(rel).REGISTRY) for rel in MODULES)


def registries() -> tuple[Any, ...]:
    """Every package's ``REGISTRY``, in page order."""
    return tuple(reg for _, reg in sources())


def all_settings() -> tuple[Any, ...]:
    """Every declared setting; a name declared by two packages raises ``SettingsError``."""
    from bytecheckpoint.settings import merge

    return merge(registries())


def _cell(text: str) -> str:
    return _NAME.sub(lambda m: f"`{m.group(0)}`", text).replace("|", "\\|")


def _default(text: str) -> str:
    if not text:
        return "—"
    if " " in text:  # prose such as "4 / ranks on the host"
        return _cell(text)
    return f"`{text}`"


def render(regs: Any = None) -> str:
    """The settings reference: a table per package, every setting of every registry once.

    ``regs``: ``(module path, registry)`` pairs, by default every package's."""
    regs = sources() if regs is None else regs
    from bytecheckpoint.settings import merge

    merge(reg for _, reg in regs)  # refuses a name declared twice before anything is rendered
    out: list[str] = []
    for rel, reg in regs:
        if not reg.settings:
            continue
        out += [f"### {reg.title}", "", f"Declared in `{rel}`.", "",
                "| variable | read by | default | meaning |", "| --- | --- | --- | --- |"]
        out += [f"| `{s.name}` | `{s.read_by}` | {_default(s.default)} | {_cell(s.meaning)} |"
                for s in reg.settings]
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
