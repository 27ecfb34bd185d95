"""``bcp tier|ingest|alerts|dashboard ...``: the services, every argument passed through."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def delegate(module: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib

        main = importlib.import_module(module).main
        try:
            return int(main(list(args.rest)) or 0)
        except SystemExit as exc:  # argparse in the service (--help, bad flags)
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)

    return run


SERVICES = {
    "tier": ("storage_tiering.__main__", "the storage tiering service (python -m storage_tiering)"),
    "ingest": ("telemetry.ingest.__main__", "the telemetry ingester, Kafka or spool -> ClickHouse "
               "(python -m telemetry.ingest)"),
    "alerts": ("telemetry.alerts.__main__", "evaluate alert rules (python -m telemetry.alerts)"),
    "dashboard": ("dashboard.__main__", "serve the Streamlit dashboard (python -m dashboard)"),
}


def register(sub: Any) -> None:
    for name, (module, help_) in SERVICES.items():
        s = sub.add_parser(name, help=help_, add_help=False,
                           description=f"{help_}; every argument is passed through, so "
                                       f"'bcp {name} --help' shows the service's own options.")
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(fn=delegate(module))
