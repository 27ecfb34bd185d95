"""MkDocs hook: the API reference page lists exactly what ``bytecheckpoint`` exports.

``docs/api.md`` holds the marker below; every build replaces it with one mkdocstrings block per
name in ``__all__`` of ``bytecheckpoint/__init__.py`` (read from the source, without importing
torch), grouped into functions, classes and errors. A name added to or dropped from ``__all__``
shows up on the page without anyone editing it.
"""

from __future__ import annotations

import ast
import os
from typing import Any

MARKER = "<!-- api-reference -->"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_INIT = os.path.join(REPO, "bytecheckpoint", "__init__.py")


def exported() -> list[str]:
    """``__all__`` of the package, in its order."""
    with open(PACKAGE_INIT) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    raise RuntimeError(f"{PACKAGE_INIT} has no __all__ list: the API page cannot be generated")


def render(names: list[str] | None = None) -> str:
    names = exported() if names is None else names
    groups = (
        ("Functions", [n for n in names if n[:1].islower()]),
        ("Classes", [n for n in names if n[:1].isupper() and not n.endswith("Error")]),
        ("Errors", [n for n in names if n.endswith("Error")]),
    )
    out: list[str] = []
    for title, members in groups:
        if members:
            out += [f"## {title}", ""]
            out += [f"::: bytecheckpoint.{n}\n" for n in members]
    return "\n".join(out)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
