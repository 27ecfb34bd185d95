"""MkDocs hook: the settings reference, rendered from the settings registry at build time.

``docs/operations.md`` holds the marker below; every build replaces it with one table per
package, made from ``bytecheckpoint/settings.py`` (the list ``tests/test_compose.py`` checks
against the source), so the page cannot drift from what the code reads. The registry is
loaded from its file, not imported through the package, so a docs build needs no torch.
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
REGISTRY = os.path.join(REPO, "bytecheckpoint", "settings.py")

# Section of the table by the top-level package that reads the setting.
SECTIONS = (
    ("bytecheckpoint", "Library: every process that saves or loads"),
    ("telemetry", "Telemetry: training processes, the ingester and the alert evaluator"),
    ("dashboard", "Dashboard"),
    ("storage_tiering", "Storage tiering"),
)
# Names of variables inside the registry's prose, set in code type on the page.
_NAME = re.compile(r"\b(?:BCP|AWS)_[A-Z0-9_]*[A-Z0-9]\b|\bLOCAL_WORLD_SIZE\b")


def load_registry() -> ModuleType:
    if not os.path.exists(REGISTRY):
        raise RuntimeError(f"the settings registry {REGISTRY} is gone: point docs/hooks/settings_table.py "
                           "at its new place")
    spec = importlib.util.spec_from_file_location("_bcp_settings_registry", REGISTRY)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _cell(text: str) -> str:
    return _NAME.sub(lambda m: f"`{m.group(0)}`", text).replace("|", "\\|")


def _default(text: str) -> str:
    if not text:
        return "—"
    if " " in text:  # prose such as "4 / ranks on the host"
        return _cell(text)
    return f"`{text}`"


def render(settings: Any = None) -> str:
    """The settings reference: a table per package, every setting of the registry once."""
    settings = load_registry().SETTINGS if settings is None else settings
    out: list[str] = []
    done = 0
    for package, title in SECTIONS:
        rows = [s for s in settings if s.read_by.split("/", 1)[0] == package]
        if not rows:
            continue
        out += [f"### {title}", "", "| variable | read by | default | meaning |", "| --- | --- | --- | --- |"]
        out += [f"| `{s.name}` | `{s.read_by}` | {_default(s.default)} | {_cell(s.meaning)} |" for s in rows]
        out.append("")
        done += len(rows)
    if done != len(settings):
        stray = sorted(s.name for s in settings if s.read_by.split("/", 1)[0] not in dict(SECTIONS))
        raise RuntimeError(f"settings read outside the known packages: {stray}; add their package to "
                           "SECTIONS in docs/hooks/settings_table.py")
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
