"""Every code example in README.md and docs/ runs, as a reader would type it.

Each ```python block of a page, and each ```bash block that runs ``bcp``, ``torchrun`` or
``python -m``, runs for real, in order, in a fresh scratch directory, in one subprocess per
page (``tests/support/docs_runner.py``; two pages at a time): python blocks share one
namespace, bash blocks run with ``.venv/bin`` first on ``PATH`` (``bcp``, ``python``,
``torchrun``). An HTML comment just before a block says how to treat it (it does not show on
the site):

- ``<!-- example: not run (why) -->``: it cannot run here (a server, a GPU, a benchmark);
- ``<!-- example: fragment -->``: not code to run (a signature);
- ``<!-- example: same as PAGE -->``: PAGE has the same block (bash: but for comments and spacing),
  which runs there (a run of its own would add its seconds and test nothing more);
- ``<!-- example: file NAME -->``: written to ``NAME`` (a script a later bash block runs);
- ``<!-- example: given`` + lines of Python + ``-->``: hidden set-up run just before the block,
  for the names the text assumes the reader has (``model``, ``optim``, ``step``...).

The blocks that do not run are listed in ``NOT_RUN`` below, so that one more is a decision.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
RUNNER = REPO / "tests" / "support" / "docs_runner.py"
PAGE_TIMEOUT_S = 180
PARALLEL_PAGES = 2
RUN_LANGS = {"python", "bash"}
# A bash block is an example when a line of it runs bcp, torchrun or `python -m` (with env
# assignments or a path before it); installs, ./scripts/*.sh, docker and bench/ runs are not.
EXAMPLE_COMMAND = re.compile(
    r"^(?:\w+=\S*\s+)*(?:\S*/)?(?:bcp\b|torchrun\b|python3?\s+-m\b)", re.MULTILINE)
FENCE = re.compile(r"^(\s*)(`{3,})(\S*)\s*$")
MARKER = re.compile(r"^\s*<!-- example: (?P<kind>not run|fragment|file|given|same as)\b(?P<rest>.*)$")

# (page, reason) of every block marked "not run"; a new one must be added here on purpose.
NOT_RUN: list[tuple[str, str]] = [
    ("docs/dashboard.md", "serves the dashboard until stopped"),
    ("docs/dashboard.md", "the 4-process demo, minutes, then a server that runs until stopped"),
    ("docs/gpu.md", "needs a CUDA GPU"),
    ("docs/telemetry.md", "needs a Kafka broker, and the first command runs until stopped"),
    ("docs/testing.md", "the test suite itself"),
    ("docs/tiering.md", "needs /ssd and /hdd tiers, and --loop runs until stopped"),
]


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    markers: dict[str, str] = field(default_factory=dict)  # kind -> argument (given: its code)


def _pages() -> list[pathlib.Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _markers_before(lines: list[str], fence: int, page: str) -> dict[str, str]:
    """The ``<!-- example: ... -->`` comments right above line ``fence`` (blank lines allowed)."""
    found: dict[str, str] = {}
    i = fence - 1
    while i >= 0:
        if not lines[i].strip():
            i -= 1
            continue
        if not lines[i].rstrip().endswith("-->"):
            break
        end = i
        while i >= 0 and "<!--" not in lines[i]:
            i -= 1
        m = MARKER.match(lines[i]) if i >= 0 else None
        if m is None:
            break
        text = "\n".join([m.group("rest"), *lines[i + 1:end + 1]]).rsplit("-->", 1)[0]
        kind = m.group("kind")
        assert kind not in found, f"{page}:{i + 1}: two '{kind}' markers on one block"
        found[kind] = text.strip("\n") if kind == "given" else text.strip()
        i -= 1
    return found


def _blocks(path: pathlib.Path) -> list[Block]:
    page = str(path.relative_to(REPO))
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, ticks, lang = m.groups()
        start, i = i, i + 1
        body = []
        while i < len(lines) and lines[i].strip() != ticks:
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        markers = _markers_before(lines, start, page)
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n", markers))
        i += 1
    return blocks


def _all_blocks() -> list[Block]:
    return [b for p in _pages() for b in _blocks(p)]


def _is_example(b: Block) -> bool:
    return b.lang == "python" or (b.lang == "bash" and EXAMPLE_COMMAND.search(b.code) is not None)


def _steps(blocks: list[Block]) -> list[dict]:
    """What the runner does for one page: the given set-up, then the block itself."""
    steps = []
    for b in blocks:
        if not _is_example(b) or {"not run", "fragment", "same as"} & b.markers.keys():
            continue
        where = {"page": b.page, "line": b.line}
        if "given" in b.markers:
            steps.append({**where, "kind": "given", "code": b.markers["given"] + "\n"})
        if "file" in b.markers:
            steps.append({**where, "kind": "file", "name": b.markers["file"], "code": b.code})
        else:
            steps.append({**where, "kind": b.lang, "code": b.code})
    return steps


def _runnable_pages() -> list[str]:
    pages = []
    for p in _pages():
        if _steps(_blocks(p)):
            pages.append(str(p.relative_to(REPO)))
    return pages


def test_markers_are_attached_to_blocks_and_not_run_is_listed() -> None:
    """Every marker sits on a block it applies to; the blocks that do not run are the listed ones."""
    blocks = _all_blocks()
    marked = sum(len(b.markers) for b in blocks)
    written = sum(len(re.findall(r"^\s*<!-- example:", p.read_text(encoding="utf-8"), re.MULTILINE))
                  for p in _pages())
    assert marked == written, "an <!-- example: ... --> comment is not right above a code block"
    for b in blocks:
        if b.markers and not _is_example(b):
            pytest.fail(f"{b.page}:{b.line}: a marker on a ```{b.lang} block that is not an example")
        if "not run" in b.markers:
            assert re.fullmatch(r"\(.+\)", b.markers["not run"]), f"{b.page}:{b.line}: say why in (...)"
    not_run = sorted((b.page, b.markers["not run"][1:-1]) for b in blocks if "not run" in b.markers)
    assert not_run == sorted(NOT_RUN)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _comparable(b: Block) -> str:
    if b.lang != "bash":
        return b.code.strip()
    return "\n".join(" ".join(line.split("#", 1)[0].split()) for line in b.code.strip().splitlines())


def test_a_block_the_same_as_another_is_the_same() -> None:
    """A block marked ``same as PAGE`` has a twin on PAGE that runs there."""
    blocks = _all_blocks()
    for b in blocks:
        if "same as" not in b.markers:
            continue
        other = b.markers["same as"]
        runs = [o for o in blocks if o.page == other and not o.markers.keys() - {"given", "file"}]
        same = [o for o in runs if o.lang == b.lang and _comparable(o) == _comparable(b)]
        assert same, f"{b.page}:{b.line}: no block on {other} that runs is the same as this one"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_page(page: str, scratch: pathlib.Path) -> tuple[int | None, str]:
    """Run one page's examples in ``scratch``/work: (exit code or None on a timeout, output)."""
    plan = scratch / "steps.json"
    plan.write_text(json.dumps(_steps(_blocks(REPO / page))), encoding="utf-8")
    work = scratch / "work"
    work.mkdir()
    venv_bin = str(pathlib.Path(sys.executable).parent)
    # HF_HUB_OFFLINE: a path typo in an example fails at once instead of retrying the Hub;
    # PET_MASTER_PORT: torchrun's default port 29500 may be taken by another job on the host.
    env = dict(os.environ, PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""),
               PYTHONDONTWRITEBYTECODE="1", HF_HUB_OFFLINE="1", PET_MASTER_PORT=str(_free_port()))
    proc = subprocess.Popen([sys.executable, str(RUNNER), str(plan)], cwd=work, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=PAGE_TIMEOUT_S)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        return None, proc.communicate()[0]
    finally:
        _kill_group(proc.pid)  # what the examples left running (a reader process, a rank)


@pytest.fixture(scope="session")
def page_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The selected pages' runs, two at a time: most of a page's time is one process importing
    torch, so two in flight halve the wall time on two cores."""
    pages = [item.callspec.params["page"] for item in request.session.items
             if getattr(item, "originalname", "") == "test_page_examples_run"]
    with concurrent.futures.ThreadPoolExecutor(max_workers=PARALLEL_PAGES) as pool:
        yield {page: pool.submit(_run_page, page, tmp_path_factory.mktemp("docs-page")) for page in pages}


@pytest.mark.parametrize("page", _runnable_pages())
def test_page_examples_run(page: str, page_runs: dict) -> None:
    code, out = page_runs[page].result()
    if code is None:
        pytest.fail(f"{page}: the examples did not finish in {PAGE_TIMEOUT_S} s\n{out[-6000:]}")
    assert code == 0, f"{page}: an example failed\n{out[-8000:]}"
