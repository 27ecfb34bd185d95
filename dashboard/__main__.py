"""python -m dashboard: serve the Streamlit dashboard on 127.0.0.1 (``bcp-dashboard`` does the same).

Examples:
  python -m dashboard --dsn chdb:///abs/path/runs/demo/store
  python -m dashboard --dsn http://user:pass@clickhouse:8123/bcp --host 0.0.0.0 --port 8501
  python -m dashboard --dsn chdb:///var/lib/bcp/store --spool /var/spool/bcp   # ingest as it serves
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from dashboard.store import DSN_ENV, SPOOL_ENV
from telemetry.store import StoreConfigError, default_dsn
from telemetry.store.client import normalize_dsn

APP = Path(__file__).with_name("app.py")


def streamlit_command(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(APP), "--server.address", host,
            "--server.port", str(port), "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--client.toolbarMode", "viewer"]


def _port(text: str) -> int:
    """An argparse type: a TCP port (streamlit would fail on another with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value}: a port is 1 to 65535")
    return value


def _bindable(host: str, port: int) -> str | None:
    """Why ``host`` cannot be bound (an unknown name or address), or None."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return f"--host {host!r}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboard", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--dsn", default=None, help="telemetry store: chdb:///ABS/PATH or "
                        "http(s)://user:pass@host:8123/db (default $BCP_CLICKHOUSE_DSN, else the "
                        "embedded store next to the spool)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=8501)
    parser.add_argument("--spool", default=None, metavar="DIR",
                        help="also ingest this spool directory into the (embedded) store while serving")
    args = parser.parse_args(argv)
    try:
        dsn = normalize_dsn(args.dsn or default_dsn())
    except StoreConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = _bindable(args.host, args.port)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    env = {**os.environ, DSN_ENV: dsn}
    if args.spool:
        env[SPOOL_ENV] = str(Path(args.spool).absolute())
    print(f"bytecheckpoint dashboard: http://{args.host}:{args.port}  (store {dsn.split('@')[-1]})",
          flush=True)
    command = streamlit_command(args.host, args.port)
    os.execve(command[0], command, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
