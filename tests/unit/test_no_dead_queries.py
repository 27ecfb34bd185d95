"""One set of read queries, no dead API: every public function of the query modules and of the
span API is called by product code (the library, services, dashboard, bench or demo), not only
by tests. A function only tests use belongs in the tests' own helpers
(tests/support/telemetry_store_reads.py)."""

from __future__ import annotations

import ast
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = ["telemetry/store/queries.py", "dashboard/queries.py", "telemetry/spans.py"]
PRODUCT = ["bytecheckpoint", "telemetry", "dashboard", "storage_tiering", "bench", "demo"]


def _public_functions(path: str) -> list[str]:
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read())
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]


def _product_sources(exclude: str) -> str:
    texts = []
    for top in PRODUCT:
        for folder, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                path = os.path.join(folder, name)
                if name.endswith(".py") and os.path.relpath(path, REPO) != exclude:
                    with open(path) as f:
                        texts.append(f.read())
    return "\n".join(texts)


@pytest.mark.parametrize("module", MODULES)
def test_every_public_function_has_a_product_caller(module: str) -> None:
    product = _product_sources(exclude=module)
    unused = [fn for fn in _public_functions(module) if not re.search(rf"\b{fn}\b", product)]
    assert not unused, f"{module}: {unused} are called by no product code; remove them or move them " \
                       "to the tests' helpers"
