"""Every environment variable the source reads is declared once, by the package that owns it.

Each package declares its settings in its own ``settings`` module (``bytecheckpoint/settings.py``
holds the machinery and the library's own); the docs build renders them (``docs/hooks/settings_table.py``).
The checks here read the source with ``ast``: a read is ``os.environ.get(X)``, ``os.getenv(X)``,
``os.environ[X]`` or ``X in os.environ`` (also on a mapping named ``env`` / ``environ`` standing for
the environment), or a call of a helper that passes its argument to one of those; ``X`` is a literal,
a constant (of the module or imported), a loop over a tuple of them, or an f-string over a
dataclass's fields (``f"BCP_TIERING_{name.upper()}"``). Shell scripts' ``${BCP_X}`` count too.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from collections import defaultdict
from dataclasses import dataclass
from types import ModuleType

import pytest

from bytecheckpoint.settings import Setting, SettingsError, merge, registry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SKIP_DIRS = {"build", "site", "runs", "test-artifacts", "__pycache__", "node_modules"}
SHELL_DIRS = ("scripts", "deploy")
PACKAGES = ("bytecheckpoint", "telemetry", "storage_tiering", "dashboard")
ENV_OBJECTS = {"env", "environ"}  # names that stand for the environment (os.environ or a copy of it)
_SHELL_READ = re.compile(r"\$\{?(BCP_[A-Z0-9_]*[A-Z0-9])\b")


@dataclass(frozen=True)
class Read:
    name: str
    path: str  # relative to the repository root
    line: int


def _hook() -> ModuleType:
    path = os.path.join(REPO, "docs", "hooks", "settings_table.py")
    spec = importlib.util.spec_from_file_location("bcp_docs_settings_hook_unit", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- reading the source ----------------------------------------------------------------------------


def _files(suffix: str, roots: tuple[str, ...] = ("",)) -> list[str]:
    out = []
    for root in roots:
        for d, dirs, files in os.walk(os.path.join(REPO, root)):
            dirs[:] = [x for x in dirs if not x.startswith(".") and x not in SKIP_DIRS
                       and not x.endswith(".egg-info")]
            out += [os.path.relpath(os.path.join(d, n), REPO) for n in files if n.endswith(suffix)]
    return sorted(out)


def _all(parts: list[list[str] | None]) -> list[str] | None:
    """Every string of ``parts``, or None when one part cannot be told."""
    if any(p is None for p in parts):
        return None
    return [s for p in parts for s in p or ()]


class _Module:
    """One parsed module: its constants, imports and parent links, for resolving names."""

    def __init__(self, rel: str, tree: ast.Module) -> None:
        self.rel, self.tree = rel, tree
        parts = rel.removesuffix(".py").split("/")
        self.dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        self.package = ".".join(parts[:-1])
        self.consts: dict[str, ast.expr] = {}
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (module, name)
        self.modules: dict[str, str] = {}  # local name -> module
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                self.consts[node.targets[0].id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
                self.consts[node.target.id] = node.value
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = self._absolute(node.module, node.level)
                for a in node.names:
                    self.imported[a.asname or a.name] = (base, a.name)
                    self.modules.setdefault(a.asname or a.name, f"{base}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    top = a.name.split(".")[0]
                    self.modules[a.asname or top] = a.name if a.asname else top

    def _absolute(self, module: str | None, level: int) -> str:
        if not level:
            return module or ""
        base = self.package.split(".")
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join([*base, module] if module else base)

    def scopes(self, node: ast.AST) -> list[ast.AST]:
        """The functions around ``node``, innermost first."""
        out = []
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                out.append(node)
        return out


class Source:
    """The environment variables read by the repository's Python and shell code."""

    def __init__(self) -> None:
        self.modules: dict[str, _Module] = {}
        for rel in _files(".py"):
            with open(os.path.join(REPO, rel), encoding="utf-8") as f:
                text = f.read()
            try:
                tree = ast.parse(text, rel)
            except SyntaxError as exc:
                pytest.fail(f"{rel} does not parse ({exc}); the settings check cannot read it")
            m = _Module(rel, tree)
            self.modules[m.dotted] = m
        self.reads: list[Read] = []
        self.unresolved: list[tuple[str, int, str]] = []  # (path, line, source) of reads not understood
        self.helpers: dict[tuple[str, str], int | str] = {}  # (module, function) -> env-name parameter
        self._scan()
        for rel in _files(".sh", SHELL_DIRS):
            with open(os.path.join(REPO, rel), encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    self.reads += [Read(n, rel, i) for n in _SHELL_READ.findall(line.split("#", 1)[0])]

    def by_name(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = defaultdict(set)
        for r in self.reads:
            out[r.name].add(r.path)
        return out

    # -- which expressions are environment reads

    @staticmethod
    def _is_env(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute) and node.attr == "environ":
            return isinstance(node.value, ast.Name) and node.value.id == "os"
        return isinstance(node, ast.Name) and node.id in ENV_OBJECTS

    def _key_of_read(self, m: _Module, node: ast.AST) -> ast.expr | None:
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and self._is_env(f.value):
                return node.args[0]
            if (isinstance(f, ast.Attribute) and f.attr == "getenv" and isinstance(f.value, ast.Name)
                    and f.value.id == "os") or (isinstance(f, ast.Name) and f.id == "getenv"):
                return node.args[0]
            target = self._helper(m, f)
            if target is not None:
                if isinstance(target, int):
                    return node.args[target] if target < len(node.args) else None
                return next((k.value for k in node.keywords if k.arg == target), None)
        if isinstance(node, ast.Call) and node.keywords:
            target = self._helper(m, node.func)
            if isinstance(target, str):
                return next((k.value for k in node.keywords if k.arg == target), None)
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and self._is_env(node.value):
            return node.slice
        if (isinstance(node, ast.Compare) and len(node.ops) == 1
                and isinstance(node.ops[0], (ast.In, ast.NotIn)) and self._is_env(node.comparators[0])):
            return node.left
        return None

    def _helper(self, m: _Module, func: ast.expr) -> int | str | None:
        if isinstance(func, ast.Name):
            if (m.dotted, func.id) in self.helpers:
                return self.helpers[(m.dotted, func.id)]
            if func.id in m.imported:
                return self.helpers.get(m.imported[func.id])
        return None

    def _scan(self) -> None:
        # Helpers are found as their reads are resolved, so scan until no new helper turns up.
        while True:
            known = len(self.helpers)
            self.reads, self.unresolved = [], []
            for m in self.modules.values():
                for node in ast.walk(m.tree):
                    key = self._key_of_read(m, node)
                    if key is None:
                        continue
                    names = self._resolve(m, key)
                    if names is None:
                        self.unresolved.append((m.rel, node.lineno, ast.unparse(node)))
                    else:
                        self.reads += [Read(n, m.rel, node.lineno) for n in names]
            if len(self.helpers) == known:
                return

    # -- what an expression names

    def _resolve(self, m: _Module, node: ast.expr, depth: int = 0) -> list[str] | None:
        """The strings ``node`` can be, or None when it cannot be told from the source."""
        if depth > 8:
            return None
        if isinstance(node, ast.Constant):
            return [node.value] if isinstance(node.value, str) else None
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return _all([self._resolve(m, e, depth + 1) for e in node.elts])
        if isinstance(node, ast.Name):
            return self._resolve_name(m, node, depth)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):  # module.CONSTANT
            other = self.modules.get(m.modules.get(node.value.id, ""))
            if other is not None and node.attr in other.consts:
                return self._resolve(other, other.consts[node.attr], depth + 1)
        if isinstance(node, ast.JoinedStr):
            return self._resolve_fstring(m, node)
        return None

    def _resolve_name(self, m: _Module, node: ast.Name, depth: int) -> list[str] | None:
        for scope in m.scopes(node):
            args = scope.args
            params = [a.arg for a in [*args.posonlyargs, *args.args]]
            if node.id in params or node.id in [a.arg for a in args.kwonlyargs]:
                if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    owner = self._function_key(m, scope)
                    self.helpers[owner] = params.index(node.id) if node.id in params else node.id
                    return []  # the helper's callers name the variables
                return None
            bound = self._bindings(scope, node.id)
            if bound:
                return _all([self._resolve(m, b, depth + 1) for b in bound])
        bound = self._bindings(m.tree, node.id, module_level=True)
        if node.id in m.consts and not bound:
            bound = [m.consts[node.id]]
        if bound:
            return _all([self._resolve(m, b, depth + 1) for b in bound])
        if node.id in m.imported:
            mod, name = m.imported[node.id]
            other = self.modules.get(mod)
            if other is not None and name in other.consts:
                return self._resolve(other, other.consts[name], depth + 1)
        return None

    def _function_key(self, m: _Module, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str]:
        return m.dotted, fn.name

    @staticmethod
    def _bindings(scope: ast.AST, name: str, module_level: bool = False) -> list[ast.expr]:
        """What ``name`` is bound to in ``scope``: assignments, and loops over a sequence."""
        out: list[ast.expr] = []
        body = scope.body if isinstance(scope, ast.Module) and module_level else [scope]
        for top in body:
            if module_level and isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for node in ast.walk(top):
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                        for t in node.targets):
                    out.append(node.value)
                elif isinstance(node, (ast.For, ast.comprehension)) and isinstance(node.target, ast.Name) \
                        and node.target.id == name:
                    out.append(node.iter)
        return out

    def _resolve_fstring(self, m: _Module, node: ast.JoinedStr) -> list[str] | None:
        """``f"PREFIX{name.upper()}"`` where ``name`` runs over ``fields(SomeDataclass)`` in the function."""
        if len(node.values) != 2 or not isinstance(node.values[0], ast.Constant):
            return None
        prefix, value = node.values[0].value, node.values[1]
        if not (isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Call)
                and isinstance(value.value.func, ast.Attribute) and value.value.func.attr == "upper"):
            return None
        scopes = m.scopes(node)
        if not scopes:
            return None
        classes = [c.args[0].id for c in ast.walk(scopes[0]) if isinstance(c, ast.Call)
                   and isinstance(c.func, ast.Name) and c.func.id == "fields" and c.args
                   and isinstance(c.args[0], ast.Name)]
        out: list[str] = []
        for cls in ast.walk(m.tree):
            if isinstance(cls, ast.ClassDef) and cls.name in classes:
                out += [f"{prefix}{s.target.id.upper()}" for s in cls.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        return out or None


@pytest.fixture(scope="module")
def source() -> Source:
    return Source()


@pytest.fixture(scope="module")
def declared() -> tuple[Setting, ...]:
    return _hook().all_settings()


# -- the registries against the source ---------------------------------------------------------------


def test_every_variable_read_is_declared(source, declared):
    names = {s.name for s in declared}
    undeclared = {n: sorted(paths) for n, paths in source.by_name().items()
                  if n.startswith("BCP_") and n not in names}
    assert not undeclared, (f"read but declared in no settings registry: {undeclared}; declare each in the "
                            "settings module of the package that reads it")


def test_every_declared_variable_is_read_where_declared(source, declared):
    read = source.by_name()
    never = sorted(s.name for s in declared if s.name not in read)
    assert not never, f"declared but read nowhere: {never}; remove them from their registry"
    wrong = {s.name: (s.read_by, sorted(read[s.name])) for s in declared if s.read_by not in read[s.name]}
    assert not wrong, f"read_by does not read the variable (declared, actually read by): {wrong}"


def test_no_variable_is_declared_twice(declared):
    names = [s.name for s in declared]
    assert len(names) == len(set(names))


def test_package_code_reads_only_names_the_check_can_see(source):
    """A read built at run time would hide a variable from the registry check: keep names literal."""
    hidden = [u for u in source.unresolved if u[0].split("/", 1)[0] in PACKAGES]
    assert not hidden, f"environment reads whose variable cannot be told from the source: {hidden}"


def test_each_package_declares_what_it_reads():
    for rel, reg in _hook().sources():
        owned = ("tests/", "scripts/") if reg.package == "tests" else (reg.package + "/",)
        assert rel.startswith(owned[0]), (rel, reg.package)
        stray = [s.name for s in reg.settings if not s.read_by.startswith(owned)]
        assert not stray, f"{rel} declares {stray}, which other packages read: move them to their owner"


def test_the_scanner_sees_each_kind_of_read(tmp_path, monkeypatch):
    """The check is only as good as its reader: each way of reading a variable is found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "names.py").write_text('OTHER_ENV = "BCP_IMPORTED"\n')
    (pkg / "mod.py").write_text(
        "import os\nfrom dataclasses import dataclass, fields\nfrom .names import OTHER_ENV\n"
        'CONST_ENV = "BCP_CONST"\nALL = (CONST_ENV, "BCP_IN_TUPLE")\n'
        "def helper(name, default=None):\n    return os.environ.get(name, default)\n"
        "@dataclass\nclass Conf:\n    hot: str = ''\n    cold_after: str = ''\n"
        "def load(env=os.environ):\n"
        "    a = os.getenv('BCP_GETENV')\n    b = os.environ['BCP_ITEM']\n    c = 'BCP_IN' in os.environ\n"
        "    d = helper('BCP_HELPER')\n    e = os.environ.get(CONST_ENV)\n    f = os.environ.get(OTHER_ENV)\n"
        "    g = [helper(n) for n in ALL]\n"
        "    for name in [f.name for f in fields(Conf)]:\n        env.get(f'BCP_CONF_{name.upper()}')\n"
        "    os.environ['BCP_WRITTEN'] = '1'\n    return os.environ.get(compute())\n")
    (tmp_path / "run.sh").write_text('X="${BCP_SHELL:-1}"  # not $BCP_COMMENTED\nBCP_SET=1 ./other\n')
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "SHELL_DIRS", ("",))
    src = Source()
    assert set(src.by_name()) == {"BCP_IMPORTED", "BCP_CONST", "BCP_IN_TUPLE", "BCP_GETENV", "BCP_ITEM",
                                  "BCP_IN", "BCP_HELPER", "BCP_CONF_HOT", "BCP_CONF_COLD_AFTER", "BCP_SHELL"}
    assert [u[2] for u in src.unresolved] == ["os.environ.get(compute())"]


# -- the registry machinery -----------------------------------------------------------------------------


def _s(name: str = "BCP_X", read_by: str = "pkg/mod.py", default: str = "", meaning: str = "what it does"):
    return Setting(name, read_by, default, meaning)


@pytest.mark.parametrize("bad, problem", [
    (_s(name="bcp_lower"), "not an environment variable name"),
    (_s(read_by="../outside.py"), "inside it"),
    (_s(read_by="/abs/mod.py"), "relative to the repository root"),
    (_s(meaning=""), "one-line meaning"),
    (_s(meaning="two\nlines"), "one-line meaning"),
    ("BCP_X", "not a Setting"),
])
def test_a_malformed_declaration_is_a_named_error(bad, problem):
    with pytest.raises(SettingsError, match=problem):
        registry("pkg", "Package", [bad])


def test_a_name_declared_twice_is_refused_within_and_across_packages():
    with pytest.raises(SettingsError, match=r"\['BCP_X'\] more than once"):
        registry("pkg", "Package", [_s(), _s(default="1")])
    a = registry("a", "A", [_s()])
    b = registry("b", "B", [_s(read_by="b/mod.py")])
    with pytest.raises(SettingsError, match="BCP_X is declared by both a and b"):
        merge([a, b])
    with pytest.raises(SettingsError, match="BCP_X is declared by both a and b"):
        _hook().render([("a/settings.py", a), ("b/settings.py", b)])


# -- the registries are light and the core stands alone ----------------------------------------------


def test_settings_modules_load_without_torch_or_upper_packages():
    code = textwrap.dedent("""
        import importlib.util, sys
        sys.path.insert(0, sys.argv[1])
        import bytecheckpoint.settings
        upper = ("telemetry", "dashboard", "storage_tiering")
        up = sorted(m for m in sys.modules if m.split(".")[0] in upper)
        assert not up, ("the core registry imports", up)
        path = sys.argv[1] + "/docs/hooks/settings_table.py"
        spec = importlib.util.spec_from_file_location("hook", path)
        hook = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hook)
        hook.all_settings()
        heavy = sorted(m for m in ("torch", "numpy", "pandas", "streamlit", "chdb") if m in sys.modules)
        assert not heavy, ("loading the registries imports", heavy)
    """)
    r = subprocess.run([sys.executable, "-c", code, REPO], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_the_reference_page_has_a_table_per_package_with_every_setting():
    hook = _hook()
    with open(os.path.join(REPO, "docs", "operations.md"), encoding="utf-8") as f:
        page = f.read()
    assert hook.MARKER in page, "docs/operations.md lost the marker the settings tables replace"
    text = hook.on_page_markdown(page)
    for rel, reg in hook.sources():
        section = text.split(f"### {reg.title}\n", 1)[1].split("\n### ", 1)[0]
        assert f"Declared in `{rel}`." in section
        rows = [line.split("|")[1].strip(" `") for line in section.splitlines() if line.startswith("| `")]
        assert rows == [s.name for s in reg.settings], rel
