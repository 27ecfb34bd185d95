"""``python -m storage_tiering``: the cooling service's entry point.

    python -m storage_tiering --once                 # one pass (cron, Kubernetes CronJob)
    python -m storage_tiering --loop                 # a pass every --interval
    python -m storage_tiering --once --dry-run       # list what a pass would do
    python -m storage_tiering --pin ckpt/step_100    # never move or delete it (--unpin undoes)

Settings: flags, then ``BCP_TIERING_*`` variables, then the TOML file of ``--config`` /
``BCP_TIERING_CONFIG`` (see :mod:`storage_tiering.config`). Exit status: 0 when every
action succeeded, 1 when one failed, 2 for a bad setting, 3 when another pass holds the lock.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from bytecheckpoint.commit.leases import pin, unpin
from bytecheckpoint.errors import CheckpointError
from bytecheckpoint.storage.redact import redact

from .config import ConfigError, load_config

if TYPE_CHECKING:
    from .service import Report


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _print(report: Report) -> None:
    verb = "would" if report.dry_run else "will"
    for d in report.decisions:
        c = d.checkpoint
        label = {"cool": f"{verb} cool", "delete": f"{verb} delete", "keep": "keep"}[d.action]
        print(f"{label:<14} {c.key:<40} step={c.step!s:<8} {c.state:<11} {c.size / 2**20:10.1f} MiB  "
              f"({d.reason})")
    if report.orphans:
        print(f"{len(report.orphans)} cold file(s) that no hot path links to (not deleted), e.g. "
              f"{report.orphans[0]}", file=sys.stderr)
    if report.dry_run:
        return
    for r in report.cooled:
        print(f"cooled {r.checkpoint}: {r.files} files, {r.bytes / 2**20:.1f} MiB in {r.seconds:.2f} s")
    for path in report.deleted:
        print(f"deleted {path}")
    for path, err in report.failed.items():
        print(f"FAILED {path}: {err}", file=sys.stderr)
    if report.recovered:
        print(f"resolved {report.recovered} interrupted operation(s) from the journal")
    print(f"hot tier: {_mib(report.hot_bytes_before)} -> {_mib(report.hot_bytes_after)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m storage_tiering", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--once", action="store_true", help="run one pass and exit")
    mode.add_argument("--loop", action="store_true", help="run a pass every --interval")
    mode.add_argument("--pin", metavar="CHECKPOINT", help="pin a checkpoint (never moved or deleted)")
    mode.add_argument("--unpin", metavar="CHECKPOINT", help="remove a pin")
    p.add_argument("--dry-run", action="store_true", help="list what the pass would do; change nothing")
    p.add_argument("--config", help="TOML file (default: $BCP_TIERING_CONFIG)")
    p.add_argument("--hot", help="hot tier root")
    p.add_argument("--cold", help="cold tier root")
    p.add_argument("--cool-after", help="age before cooling, e.g. 7d, 12h, 3600")
    p.add_argument("--keep-newest", type=int, help="newest checkpoints of each run kept hot")
    p.add_argument("--delete-after", help="retention: delete checkpoints older than this")
    p.add_argument("--keep-every", type=int, help="retention keeps steps that are multiples of this")
    p.add_argument("--interval", help="loop mode: time between passes")
    p.add_argument("--reason", default="", help="with --pin: why")
    args = p.parse_args(argv)
    from .service import ServiceBusy, run_loop, run_once  # after parsing: --help needs no torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        if args.pin:
            print(f"pinned: {pin(args.pin, args.reason)}")
            return 0
        if args.unpin:
            print("unpinned" if unpin(args.unpin) else "was not pinned")
            return 0
    except (OSError, CheckpointError) as exc:  # a missing directory, no permission: one line
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1
    try:
        config = load_config(args.config, hot=args.hot, cold=args.cold, cool_after=args.cool_after,
                             keep_newest=args.keep_newest, delete_after=args.delete_after,
                             keep_every=args.keep_every, interval=args.interval)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.loop:
            run_loop(config)
            return 0
        report = run_once(config, dry_run=args.dry_run)
    except ServiceBusy as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (OSError, CheckpointError) as exc:  # the scan itself failed (permissions, a lost mount)
        print(f"error: {redact(str(exc))}", file=sys.stderr)
        return 1
    _print(report)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
