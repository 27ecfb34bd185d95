"""``bcp --version`` and ``bcp --help`` answer without importing torch, and the lazy package still
exposes the whole public API (``bcp.save``, ``from bytecheckpoint import *``)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OWN = ["ls", "inspect", "verify", "export", "import", "gc", "convert"]

# Runs bcp's main in a fresh interpreter, then reports whether torch was imported along the way.
PROBE = """
import sys
from bytecheckpoint.cli.app import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # argparse's --help and --version exit
    code = exc.code
print("TORCH" if "torch" in sys.modules else "NO-TORCH", code)
"""


def probe(*argv: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@pytest.mark.parametrize("argv", [["--version"], ["--help"], *[[cmd, "--help"] for cmd in OWN]],
                         ids=lambda a: " ".join(a))
def test_help_and_version_do_not_import_torch(argv: list[str]) -> None:
    out, _ = probe(*argv)
    assert out.splitlines()[-1] == "NO-TORCH 0", out


def test_version_is_the_installed_distribution_version() -> None:
    out, _ = probe("--version")
    assert out.splitlines()[0] == f"bcp (bytecheckpoint) {importlib.metadata.version('bytecheckpoint')}"


def test_public_api_resolves_lazily() -> None:
    code = ("import bytecheckpoint as bcp, sys; assert 'torch' not in sys.modules; "
            "from bytecheckpoint import *; "
            "assert callable(save) and callable(load) and callable(verify) and TensorShard and SaveHandle; "
            "assert bcp.save is save and bcp.commit.integrity.verify is verify; "
            "assert set(bcp.__all__) <= set(dir(bcp)); "
            "import bytecheckpoint.format.metadata as m; "
            "assert m.__version__ == bcp.__version__; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr


def test_unknown_attribute_is_an_attribute_error() -> None:
    import bytecheckpoint

    with pytest.raises(AttributeError, match="no_such_thing"):
        bytecheckpoint.no_such_thing  # noqa: B018
    assert not hasattr(bytecheckpoint, "__wrapped__")
