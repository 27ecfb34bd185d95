"""One pass of the cooling service, and the loop around it.

A pass takes an exclusive lock on the cold tier (a second service, or a cron run that
overlaps the previous one, finds it held and stops), resolves what a crash interrupted,
scans the hot tier, decides, and moves or deletes. One checkpoint's failure is reported
(``tiering.move`` span with outcome ``error``, which the ``failed_ops`` alert rule turns
into an alert) and the pass goes on with the next.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

from bytecheckpoint.manage.catalog import cold_references, hot_bytes, orphans, scan
from bytecheckpoint.manage.deletion import delete_checkpoint, delete_on_storage, recover_unjournaled
from bytecheckpoint.manage.journal import JOURNAL_FILE, LOCK_FILE, Journal, TierBusyError, exclusive
from bytecheckpoint.storage import open_storage
from bytecheckpoint.storage.redact import redact
from telemetry import context, get_context, span

from .config import ConfigError, TieringConfig, check_apart
from .hdfs import HdfsCli, HdfsMover, PolicyAdmin, scan_remote
from .mover import Hook, Mover, MoveResult, recover
from .plan import Decision, decide

log = logging.getLogger("storage_tiering")
ServiceBusy = TierBusyError  # another tiering pass (or bcp gc) holds the cold tier's lock
__all__ = ["LOCK_FILE", "Report", "ServiceBusy", "run_loop", "run_once"]


@dataclass
class Report:
    decisions: list[Decision] = field(default_factory=list)
    cooled: list[MoveResult] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # checkpoint path -> error
    recovered: int = 0
    orphans: list[str] = field(default_factory=list)  # cold files no hot path links to
    hot_bytes_before: int = 0
    hot_bytes_after: int = 0
    dry_run: bool = False

    @property
    def changed(self) -> bool:
        return bool(self.cooled or self.deleted or self.recovered)


def run_once(config: TieringConfig, *, dry_run: bool = False, now: float | None = None,
             on_step: Hook | None = None, admin: PolicyAdmin | None = None) -> Report:
    """One pass: recover, scan, decide, act. ``now`` overrides the clock (tests);
    ``on_step`` is called at each step of a move (crash tests); ``admin`` carries out
    storage policies in HDFS mode (default: the Hadoop command line)."""
    # The service is a process of its own: its events count as rank 0 of a one-rank world,
    # so the alert rules (which group by rank) see failed moves.
    own = {} if get_context().get("rank") is not None else {"rank": 0, "world_size": 1}
    with context(**own):
        return _run(config, dry_run, now, on_step, admin)


def _run(config: TieringConfig, dry_run: bool, now: float | None, on_step: Hook | None,
         admin: PolicyAdmin | None) -> Report:
    if config.mode == "hdfs":
        return _run_hdfs(config, dry_run, time.time() if now is None else now, on_step, admin or HdfsCli())
    for label, root in (("hot", config.hot), ("cold", config.cold)):
        # Never create a missing tier: an unmounted disk would be filled in its mount point.
        if not os.path.isdir(root):
            raise ConfigError(f"the {label} tier {root} is not a directory (is the disk mounted?)")
    check_apart(config.hot, config.cold)  # again: a symlink may have changed since the start
    report = Report(dry_run=dry_run)
    journal = Journal(config.cold)
    with exclusive(config.cold):
        if not dry_run:
            report.recovered = recover(config.hot, config.cold, journal)
            report.recovered += recover_unjournaled(config.hot, config.cold)  # `bcp gc` without --cold
        _refuse_missing_cold(config.hot, config.cold)
        with span("tiering.scan", path=config.hot) as ev:
            checkpoints = scan(config.hot, config.cold)
            report.hot_bytes_before = hot_bytes(config.hot)
            report.decisions = decide(checkpoints, config, now=time.time() if now is None else now)
            ev.set(checkpoints=len(checkpoints), bytes=report.hot_bytes_before,
                   to_cool=sum(d.action == "cool" for d in report.decisions),
                   to_delete=sum(d.action == "delete" for d in report.decisions))
        if dry_run:
            report.hot_bytes_after = report.hot_bytes_before
            report.orphans = orphans(config.hot, config.cold, frozenset({JOURNAL_FILE, LOCK_FILE}))
            return report
        mover = Mover(config.hot, config.cold, journal, on_step)
        for d in report.decisions:
            try:
                if d.action == "cool":
                    report.cooled.append(mover.cool(d.checkpoint))
                elif d.action == "delete":
                    delete_checkpoint(d.checkpoint, config.hot, config.cold, journal)
                    report.deleted.append(d.checkpoint.path)
            except Exception as exc:  # one checkpoint's failure must not stop the pass
                log.error("tiering: %s of %s failed: %s", d.action, d.checkpoint.path, redact(str(exc)))
                report.failed[d.checkpoint.path] = redact(f"{type(exc).__name__}: {exc}")
        report.hot_bytes_after = hot_bytes(config.hot)
        report.orphans = orphans(config.hot, config.cold, frozenset({JOURNAL_FILE, LOCK_FILE}))
        if report.orphans:
            log.warning("tiering: %d cold file(s) that no hot path links to, e.g. %s (not deleted)",
                        len(report.orphans), report.orphans[0])
    return report


def _refuse_missing_cold(hot: str, cold: str) -> None:
    """Refuse a pass while hot links point at cold files that are not there: the cold tier is
    unmounted (its mount point left empty) or was moved. Cooling into the empty mount point
    would hide the new copies under the disk once it is mounted again, losing those
    checkpoints."""
    missing = sorted(t for t, links in cold_references(hot, cold).items()
                     if not os.path.lexists(t) and any(_visible(link, hot) for link in links))
    if missing:
        raise ConfigError(f"the cold tier {cold} lacks {len(missing)} cold file(s) that hot links point "
                          f"to, e.g. {missing[0]}: is the disk mounted? Nothing was cooled or deleted. "
                          "Mount it (or put the cold tier back where the links point); if those files "
                          "were deleted, remove the checkpoints that link to them")


def _visible(path: str, root: str) -> bool:
    """``path`` lies in no hidden directory below ``root`` (a deletion's trash or a move's scratch
    directory, which their recovery resolves, is not a checkpoint)."""
    return not any(part.startswith(".") for part in os.path.relpath(path, root).split(os.sep))


def _run_hdfs(config: TieringConfig, dry_run: bool, now: float, on_step: Hook | None,
              admin: PolicyAdmin) -> Report:
    """HDFS mode: the same decisions, carried out by storage policies and the HDFS Mover.
    Retention deletes through the storage layer (checkpoint directory, metadata first)."""
    storage, root = open_storage(config.hot)
    report = Report(dry_run=dry_run)
    mover = HdfsMover(storage, admin, config.cold_policy, on_step)
    with span("tiering.scan", path=config.hot) as ev:
        checkpoints = scan_remote(storage, root, admin, config.cold_policy)
        if not dry_run:
            report.recovered = mover.recover(checkpoints)
            if report.recovered:
                checkpoints = scan_remote(storage, root, admin, config.cold_policy)
        report.decisions = decide(checkpoints, config, now=now)
        ev.set(checkpoints=len(checkpoints), to_cool=sum(d.action == "cool" for d in report.decisions),
               to_delete=sum(d.action == "delete" for d in report.decisions))
    if dry_run:
        return report
    for d in report.decisions:
        try:
            if d.action == "cool":
                report.cooled.append(mover.cool(d.checkpoint))
            elif d.action == "delete":
                # Checked again under the path's save lock (the Mover may have run for hours
                # since the scan): pins, leases, latest, a new save at the path.
                delete_on_storage(storage, d.checkpoint, cold_in_place=True)
                report.deleted.append(storage.url(d.checkpoint.path))
        except Exception as exc:
            url = redact(storage.url(d.checkpoint.path))
            log.error("tiering: %s of %s failed: %s", d.action, url, redact(str(exc)))
            report.failed[url] = redact(f"{type(exc).__name__}: {exc}")
    return report


def run_loop(config: TieringConfig, *, iterations: int | None = None) -> None:
    """Run a pass every ``config.interval`` seconds (measured start to start)."""
    done = 0
    while iterations is None or done < iterations:
        started = time.monotonic()
        try:
            report = run_once(config)
            log.info("tiering pass: %d cooled, %d deleted, %d failed, %d recovered", len(report.cooled),
                     len(report.deleted), len(report.failed), report.recovered)
        except ServiceBusy as exc:
            log.warning("%s", exc)
        except (OSError, ConfigError) as exc:  # a tier unmounted for a while: try again next time
            log.error("tiering pass failed: %s", redact(str(exc)))
        done += 1
        if iterations is None or done < iterations:
            time.sleep(max(0.0, config.interval - (time.monotonic() - started)))
