"""What every command shares: exit codes, errors, output helpers, argument types."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import NotACheckpointError

# Exit codes (also in docs/cli.md): scripts may rely on them.
EXIT_OK = 0
EXIT_FAILED = 1  # the check failed: verify found bad files, gc could not delete everything
EXIT_USAGE = 2  # bad command line or option value
EXIT_NOT_A_CHECKPOINT = 3  # no checkpoint there, or it never committed
EXIT_CORRUPT = 4  # metadata or storage files unreadable, unsafe or inconsistent
EXIT_EXISTS = 5  # the output exists (pass --overwrite)
EXIT_STORAGE = 6  # the storage failed (after its retries) or refused
EXIT_NEWER_FORMAT = 7  # a checkpoint of a newer format than this release reads: upgrade
EXIT_INTERNAL = 70  # an unexpected error (a bug): one line, the traceback with --debug
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # the reader of the output went away (| head), as for SIGPIPE

EPILOG = """exit codes:
  0  success
  1  the check failed: verify found bad files, gc could not delete a checkpoint
  2  bad command line, option or BCP_* setting value, or an unusable export/import/convert
     input
  3  not a checkpoint (nothing there, or a save that never committed)
  4  corrupt or unsafe checkpoint (unreadable metadata, missing or damaged file)
  5  the output already exists (pass --overwrite)
  6  storage error (failed after retries, or refused: permissions, full disk, bucket)
  7  the checkpoint is of a newer format than this bcp reads (upgrade bytecheckpoint)
  70  unexpected internal error (a bug; --debug or BCP_DEBUG=1 prints the traceback)
  130 interrupted
  141 the output pipe was closed (e.g. bcp ls | head): stopped quietly
bcp tier / ingest / alerts / dashboard exit with the code of the service they run."""


Adder = Callable[..., argparse.ArgumentParser]  # add(name, help, description) -> subparser


class UsageError(Exception):
    """A bad option value found after parsing (exit code 2)."""


def human(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


@contextmanager
def progress(description: str, total: int | None, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr (a terminal only); yields ``advance(n)``."""
    if not enabled or not sys.stderr.isatty():
        yield lambda n: None
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:  # rich is optional (the `cli` extra)
        yield lambda n: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (a bad one is a usage error, exit 2)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is less than {minimum}")
        return value

    parse.__name__ = "count"  # what argparse names in its message
    return parse


def location(text: str) -> str:
    """An argparse type for a path or URL: an empty one is a usage error, never the current
    directory (``bcp gc "$UNSET_VAR" --yes`` must not collect garbage wherever it runs)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path: give a directory or a storage URL")
    return text


def resolve_checkpoint(url: str) -> tuple[Any, str]:
    """The checkpoint at ``url``; a local path that is a file (or a device) is no checkpoint."""
    from ..commit.integrity import resolve
    from ..storage import split_url

    scheme, local = split_url(url)
    if scheme == "file" and os.path.lexists(local) and not os.path.isdir(local):
        raise NotACheckpointError(f"{url} is a file, not a checkpoint directory (a checkpoint is a "
                                  "directory holding metadata.msgpack, or a root with a 'latest' pointer)")
    return resolve(url)


def step_key(c: Any) -> tuple[str, int, str]:
    """A sort key every catalog entry has, whatever its step (an odd one sorts first)."""
    return (str(c.run), c.step if isinstance(c.step, int) else -1, str(c.name))


def cold_arg(root: Any, cold: str | None) -> str | None:
    """--cold (or $BCP_TIERING_COLD) as an absolute path; it only applies to a local root."""
    if not cold or not root.local:
        return None
    cold_root = os.path.abspath(cold)
    if not os.path.isdir(cold_root):
        raise UsageError(f"--cold {cold_root}: no such directory (is the cold tier mounted?)")
    return cold_root
