"""Library fixes found by running the documentation's examples (tests/e2e/test_docs_examples.py):
each test is the smallest program that showed the fault, in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

EXIT_TIMEOUT_S = 30


def _run(tmp_path, code: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(code), encoding="utf-8")
    try:
        return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                              text=True, timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the program did not exit in {EXIT_TIMEOUT_S} s: {exc.stdout!r} {exc.stderr!r}")


@pytest.mark.parametrize("handler", ["manager", "own"])
def test_a_program_that_leaves_its_loader_open_exits(tmp_path, handler):
    # Was: docs/guide/manager.md's loop hung at exit, forever. The readers are forked after the
    # manager (preemption=True) replaced SIGTERM's handler, so they inherit it; at exit
    # multiprocessing ends its daemon children with SIGTERM, which they then ignore, and joins them.
    install = {
        "manager": 'mgr = bcp.CheckpointManager("ckpt", save_every_steps=1, preemption=True)',
        "own": "signal.signal(signal.SIGTERM, lambda *a: None)  # a launcher's own handler",
    }[handler]
    done = _run(tmp_path, f"""
        import signal
        import bytecheckpoint as bcp
        from bytecheckpoint.data import TokenLoader, synthetic_sources

        {install}
        loader = TokenLoader(synthetic_sources("data", [40], vocab=50), [1.0], context=7, batch_size=2,
                             workers=2)
        next(loader)
        print("done", flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"
