"""``bcp``: the operator's command line.

    bcp ls ROOT                 runs and checkpoints under a root
    bcp inspect PATH            what a checkpoint holds
    bcp verify PATH             re-check every checksum
    bcp export PATH OUT         Hugging Face safetensors shards
    bcp import SRC DST          a Hugging Face directory into a checkpoint
    bcp convert --from dcp|torch SRC DST, --to dcp SRC DST   PyTorch formats in and out
    bcp gc ROOT                 retention (dry run unless --yes)
    bcp tier|ingest|alerts|dashboard ...   the services (arguments passed through)

``ls`` and ``gc`` take a local root or a storage URL (s3://); they list through the core's catalog
and decide with its protection rule, so they see checkpoints exactly as the manager and tiering do.

One module per command (``cli/<command>.py``: its ``register(add)`` builds its parser, its
``cmd_*`` runs it); this one builds the parser and dispatches. Nothing here imports torch until a
command runs, so ``bcp --help`` and ``bcp --version`` answer at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    InvalidSettingError,
    InvalidStorageURLError,
    NewerFormatError,
    NotACheckpointError,
    StorageError,
)
from ..storage.redact import redact
from . import convert, export, gc, import_, inspect, ls, preflight, services, verify
from .common import (  # noqa: F401 - the exit codes are part of this module's interface
    EPILOG,
    EXIT_BROKEN_PIPE,
    EXIT_CORRUPT,
    EXIT_EXISTS,
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NEWER_FORMAT,
    EXIT_NOT_A_CHECKPOINT,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
    UsageError,
)
from .gc import plan_gc  # noqa: F401
from .services import SERVICES, delegate


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="bcp", description="bytecheckpoint's operator command line.\n\n"
                                + "\n".join(__doc__.splitlines()[2:14]), epilog=EPILOG, formatter_class=fmt)
    p.add_argument("--version", action="version", version=_version())
    p.add_argument("--debug", action="store_true",
                   help="print the full traceback of an unexpected error (also BCP_DEBUG=1)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, help_: str, description: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=description or help_, epilog=EPILOG,
                              formatter_class=fmt)

    ls.register(add)
    inspect.register(add)
    verify.register(add)
    export.register(add)
    import_.register(add)
    convert.register(add)
    gc.register(add)
    services.register(sub)
    return p


def _version() -> str:
    from .._version import __version__

    return f"bcp (bytecheckpoint) {__version__}"


def _debug(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get("BCP_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def _failure(exc: BaseException) -> tuple[str, int]:
    """The one-line message (after ``bcp COMMAND:``) and the exit code of an error."""
    from ..tools.export import ExportError

    if isinstance(exc, UsageError):
        return f"error: {exc}", EXIT_USAGE
    if isinstance(exc, InvalidStorageURLError):
        return f"error: {exc}", EXIT_USAGE
    if isinstance(exc, InvalidSettingError):
        return f"configuration error: {exc}", EXIT_USAGE
    if isinstance(exc, NotACheckpointError):
        return f"not a checkpoint: {exc}", EXIT_NOT_A_CHECKPOINT
    if isinstance(exc, NewerFormatError):  # not damaged: verify would not help
        return f"newer format: {exc}", EXIT_NEWER_FORMAT
    if isinstance(exc, CorruptCheckpointError):
        return (f"corrupt checkpoint: {exc}\n(run 'bcp verify' on it to list every bad file)",
                EXIT_CORRUPT)
    if isinstance(exc, CheckpointExistsError):
        return str(exc), EXIT_EXISTS
    if isinstance(exc, StorageError):
        return f"storage error: {exc}", EXIT_STORAGE
    if isinstance(exc, ExportError):
        return f"error: {exc}", EXIT_USAGE
    if isinstance(exc, CheckpointError):
        return f"error: {exc}", EXIT_FAILED
    if isinstance(exc, (FileNotFoundError, NotADirectoryError)):
        return f"not found: {exc.filename or exc}: {exc.strerror or exc}", EXIT_NOT_A_CHECKPOINT
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"storage error: {where}{exc.strerror or exc}", EXIT_STORAGE
    return (f"internal error: {type(exc).__name__}: {exc} (a bug: run with --debug or BCP_DEBUG=1 "
            "for the traceback, and report it)", EXIT_INTERNAL)


def _quiet_broken_pipe() -> int:
    """The reader of our output went away (``bcp ls | head``): stop quietly, as ``cat`` does.
    stdout is pointed at /dev/null so the interpreter's final flush cannot complain either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = _debug(argv[:1])
    if argv[:1] == ["--debug"]:
        argv = argv[1:]
    _log_to_stderr()
    parser = build_parser()
    if argv and argv[0] in SERVICES:
        # Everything after the service name is the service's own (argparse's REMAINDER would
        # take '--help' as bcp's).
        args = argparse.Namespace(command=argv[0], rest=argv[1:], fn=delegate(SERVICES[argv[0]][0]))
    else:
        try:
            args = parser.parse_args(argv)
        except BrokenPipeError:
            return _quiet_broken_pipe()
    try:
        if args.command not in SERVICES:  # the services check their own settings
            preflight.check_settings()
            preflight.probe(args)
        code = args.fn(args)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt:
        print(f"bcp {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every error becomes one line and an exit code
        message, code = _failure(exc)
        if debug:
            traceback.print_exc()
        try:
            print(f"bcp {args.command}: {redact(message)}", file=sys.stderr)
        except BrokenPipeError:
            pass
        return code


def _log_to_stderr() -> None:
    """Warnings of the library (storage retries, lease trouble) go to stderr, one line each."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("bcp: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
