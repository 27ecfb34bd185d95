"""``bcp`` argument vectors: subcommands, hostile paths and option values.

A case runs ``bytecheckpoint.cli.app(argv)`` in the worker process with stdout and stderr
captured. Acceptable: a documented exit code and no traceback on stderr. A file outside the
workspace that goes missing (``gc`` or ``export`` deleting what it was not given) is wrong
data; a case that does not return (a FIFO read) is a hang, caught by the guard's time limit.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil

from tests.fuzz.checkpoint import Seed
from tests.fuzz.mutate import apply_bytes
from tests.fuzz.outcomes import OK, RAW, WRONG, Result

# The documented exit codes of bcp; 70 ("internal error") is not among them: it means an
# unexpected exception escaped, which the fuzzer counts as a raw error.
EXIT_CODES = frozenset({0, 1, 2, 3, 4, 5, 6, 130, 141})
COMMANDS = ("ls", "inspect", "verify", "export", "import", "gc")
VALUES = ("0", "-1", "1", "2", "abc", "", "1e20", "99999999999999999999", "nan", "-0", "5GB", "0B", "-5GB",
          "1KB", "x=y", "=", "model.", "float32", "bogus")
OPTIONS = {
    "ls": ("--json", "--cold"),
    "inspect": ("--json", "--all", "--max-rows"),
    "verify": ("--threads", "--json", "-q"),
    "export": ("--max-shard-size", "--dtype", "--strip-prefix", "--rename", "--include-optimizer",
               "--model-key", "--tied", "--overwrite", "--json", "-q"),
    "import": ("--model-key", "--strip-prefix", "--rename", "--tie", "--step", "--overwrite", "--json"),
    "gc": ("--keep-last", "--keep-every", "--yes", "--cold", "--json", "-q"),
}
_FLAGS = frozenset({"--json", "--all", "-q", "--include-optimizer", "--overwrite", "--yes"})


class Workspace:
    """Paths the argument vectors point at, rebuilt before every case that may write."""

    def __init__(self, base: str, seed: Seed) -> None:
        self.base, self.seed = base, seed
        self.victim = os.path.join(base, "outside", "precious.txt")

    def build(self) -> None:
        root = os.path.join(self.base, "ws")
        if os.path.isdir(root):
            shutil.rmtree(root)
        os.makedirs(os.path.join(root, "root"))
        for step in (1, 2, 3):
            self.seed.write(os.path.join(root, "root", f"step_{step}"))
        with open(os.path.join(root, "root", "latest"), "w") as f:
            f.write('{"checkpoint": "step_3", "step": 3}')
        meta = self.seed.files["metadata.msgpack"]
        flipped = apply_bytes(meta, [("flip", 40, 3)])
        self.seed.write(os.path.join(root, "corrupt"), {"metadata.msgpack": flipped})
        model = self.seed.file_named("model-00000.safetensors")
        self.seed.write(os.path.join(root, "truncated"), {model: b"\x00" * 8})
        self.seed.write(os.path.join(root, "fifo"))
        os.remove(os.path.join(root, "fifo", model))
        os.mkfifo(os.path.join(root, "fifo", model))
        self.seed.write(os.path.join(root, "dirfile"))
        os.remove(os.path.join(root, "dirfile", model))
        os.mkdir(os.path.join(root, "dirfile", model))
        os.makedirs(os.path.join(root, "empty"))
        os.makedirs(os.path.join(root, "cold"))
        with open(os.path.join(root, "plain.txt"), "w") as f:
            f.write("not a checkpoint")
        os.makedirs(os.path.dirname(self.victim), exist_ok=True)
        with open(self.victim, "w") as f:
            f.write("keep me")
        os.symlink(os.path.dirname(self.victim), os.path.join(root, "root", "step_9"))
        os.symlink(os.devnull, os.path.join(root, "devnull"))

    def expand(self, arg: str) -> str:
        """A placeholder argument (``{ws}/root``) made concrete for this workspace."""
        return arg.replace("{ws}", os.path.join(self.base, "ws"))


# Arguments as stored in cases and the corpus: ``{ws}`` is the workspace of the run.
PLACEHOLDER_PATHS = tuple(f"{{ws}}/{p}" for p in (
    "root", "root/step_1", "root/step_3", "root/step_9", "corrupt", "truncated", "fifo", "dirfile", "empty",
    "plain.txt", "missing", "root/latest", "out", "root/step_1/metadata.msgpack")) + (
    "{ws}/devnull", "file://{ws}/missing", "s3://", "mem://", "", ".", "-")
# Not here: s3://bucket or hdfs://host, which retry an unreachable endpoint for a bounded but long
# time (tens of seconds, logged): a fuzz case must not depend on the network.


def random_argv(rng: random.Random, paths: tuple[str, ...]) -> list[str]:
    command = rng.choice(COMMANDS)
    argv = [command]
    positional = 2 if command in ("export", "import") else 1
    argv += [rng.choice(paths) for _ in range(positional if rng.random() < 0.9 else rng.randrange(3))]
    if command == "gc" and rng.random() < 0.8:
        argv += ["--keep-last", rng.choice(("1", "0", "-1", "2", "abc"))]
    for _ in range(rng.randrange(4)):
        option = rng.choice(OPTIONS[command])
        argv.append(option)
        if option not in _FLAGS:
            argv.append(rng.choice(paths) if option == "--cold" else rng.choice(VALUES))
    if rng.random() < 0.1:
        argv.insert(rng.randrange(len(argv) + 1), rng.choice(("--bogus", "-h", "--", "--json=1")))
    return argv


def cli_case(argv: list[str], workspace: Workspace) -> Result:
    from bytecheckpoint.cli import app as cli
    out, err = io.StringIO(), io.StringIO()
    os.chdir(os.path.join(workspace.base, "ws"))  # relative paths ("." "-") stay in the workspace
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
    except SystemExit as exc:  # argparse: usage errors and --help
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException as exc:  # noqa: BLE001 - an escaped exception is the finding
        return Result(RAW, f"bcp {' '.join(argv)}: {type(exc).__name__}: {exc}"[:800])
    if "Traceback" in err.getvalue():
        return Result(RAW, f"bcp {' '.join(argv)}: traceback on stderr:\n{err.getvalue()[-1500:]}")
    if code not in EXIT_CODES:
        return Result(RAW, f"bcp {' '.join(argv)}: undocumented exit code {code!r}")
    if not os.path.exists(workspace.victim):
        return Result(WRONG, f"bcp {' '.join(argv)}: deleted a file outside every path it was given")
    return Result(OK)
