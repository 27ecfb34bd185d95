"""``bcp gc ROOT``: retention for a root (dry run unless ``--yes``), decided by the core's protection
rule and policies (:mod:`bytecheckpoint.manage`), deleted with the cold copies only it uses."""

from __future__ import annotations

import argparse
import contextlib
import os
import posixpath
import sys
from collections.abc import Sequence
from typing import Any

from .common import (
    EXIT_FAILED,
    EXIT_OK,
    Adder,
    UsageError,
    cold_arg,
    human,
    location,
    print_json,
    progress,
    step_key,
)


def _tier_root(hot_root: str, cold_root: str | None, paths: list[str]) -> str:
    """The hot tier's root when ``hot_root`` is a part of it (one run): the cold tier mirrors the
    whole hot tier, so a cold link's path minus its target's path under the cold root says where
    that tier starts. Deletes must count the links of every checkpoint in it (a ``cp -a`` copy
    elsewhere in the tier shares the cold files), not only those under the directory given."""
    if cold_root is None:
        return hot_root
    real_cold = os.path.realpath(cold_root)
    for path in paths:
        for name in sorted(os.listdir(path)) if os.path.isdir(path) else []:
            link = os.path.join(os.path.abspath(path), name)
            if not os.path.islink(link):
                continue
            target = os.path.realpath(link)
            rel = os.path.relpath(target, real_cold)
            if rel.startswith(os.pardir) or not link.endswith(os.sep + rel):
                continue
            tier = link[: -len(rel) - 1] or os.sep
            if os.path.commonpath([tier, hot_root]) == tier and tier != os.sep:
                return tier
    return hot_root


def plan_gc(checkpoints: Sequence[Any], *, keep_last: int, keep_every: int) -> list[Any]:
    """Retention decision per checkpoint (``bytecheckpoint.manage.retention.Decision``): delete
    a committed checkpoint unless it is among the newest ``keep_last`` of its run's live
    timeline, its step is a multiple of ``keep_every``, or it is protected
    (:mod:`bytecheckpoint.manage.protection`: uncommitted, a save under way, pinned, being read,
    named by ``latest``, abandoned by a rollback, or impossible to classify). The newest
    committed checkpoint of each run is always kept, whatever ``keep_last`` says. The policies,
    the per-run counting and the protection rule are the manager's and the tiering service's."""
    from ..manage.retention import Context, Decision, KeepEvery, KeepLast, any_of, kept_by, plan_deletions

    ctx = Context(now=0.0)
    last = KeepLast(max(keep_last, 1))
    every = [KeepEvery(keep_every)] if keep_every else []
    newest = kept_by(checkpoints, last, context=ctx)
    out = []
    for i, d in enumerate(plan_deletions(checkpoints, any_of([last, *every]), context=ctx)):
        if d.delete:
            out.append(Decision(d.checkpoint, True, "beyond --keep-last"))
        elif d.reason == "kept by the retention policy":
            why = (f"among the newest {last.k} of its run" if newest[i]
                   else f"step is a multiple of {keep_every}")
            out.append(Decision(d.checkpoint, False, why))
        else:
            out.append(d)
    return out


def _check_gc_root(root: str) -> None:
    """Refuse roots whose scan could reach far more than checkpoints: / and the home directory."""
    real = os.path.realpath(root)
    home = os.path.realpath(os.path.expanduser("~"))
    if real == os.path.realpath(os.sep) or real == home:
        raise UsageError(f"refusing to collect garbage in {real} (the file system root or the home "
                         "directory): give the directory that holds the runs' checkpoints")


def _cold_tier_of(path: str) -> str | None:
    """The cold tier ``path`` is or lies in: the nearest directory at or above it that holds a
    tiering journal or lock, which only a cold tier has (every pass creates them). Its
    checkpoints are copies the hot tier's links point to: deleting one destroys the hot one."""
    from ..manage.journal import JOURNAL_FILE, LOCK_FILE

    d = os.path.realpath(path)
    while True:
        if any(os.path.lexists(os.path.join(d, n)) for n in (JOURNAL_FILE, LOCK_FILE)):
            return d
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


def _check_tiers(hot: str, cold_root: str | None) -> None:
    """Refuse a root that is (in) a cold tier, and a --cold that overlaps the root: gc would
    take the cold copies for checkpoints of their own and delete what hot links point to."""
    tier = _cold_tier_of(hot)
    if tier is not None:
        raise UsageError(f"{hot} is in the cold tier {tier} (it holds the tiering journal): run gc on "
                         f"the hot root with --cold {tier}")
    if cold_root is not None:
        real_hot, real_cold = os.path.realpath(hot), os.path.realpath(cold_root)
        if os.path.commonpath([real_hot, real_cold]) in (real_hot, real_cold):
            raise UsageError(f"--cold {real_cold} and the root {real_hot} must not contain each other "
                             "(the cold tier is a separate directory the hot files link into)")


def _refuse_unmounted_cold(checkpoints: Sequence[Any], cold_root: str | None) -> None:
    """With --cold, refuse while checkpoints link to cold files missing from it: the cold disk is
    unmounted (its mount point left empty). The lock and the journal of deletions would go into
    the mount point, hidden under the disk once it is mounted again."""
    if cold_root is None:
        return
    from ..errors import ColdTierUnavailableError
    from ..manage.catalog import inside

    real = os.path.realpath(cold_root)
    missing = [c.unreachable for c in checkpoints if c.unreachable and inside(c.unreachable, real)]
    if missing:
        raise ColdTierUnavailableError(
            f"--cold {cold_root} lacks {len(missing)} cold file(s) that checkpoints link to, e.g. "
            f"{missing[0]}: is the cold disk mounted? Nothing was deleted. Mount it and run gc again "
            "(without --cold, gc keeps those checkpoints and may delete hot ones)", missing=missing[0])


def _keep_cold_copies(decisions: list[Any]) -> list[Any]:
    """A checkpoint under ROOT that lies in a cold tier (ROOT holds both tiers) is kept: it is
    the bytes of a hot checkpoint, deleted only with it."""
    from ..manage.retention import Decision

    out = []
    for d in decisions:
        tier = _cold_tier_of(d.checkpoint.path) if d.delete else None
        out.append(d if tier is None else Decision(
            d.checkpoint, False, f"a copy in the cold tier {tier}: deleted only with its hot checkpoint "
                                 f"(run gc on the hot root with --cold {tier})"))
    return out


def _needs_cold(c: Any) -> str:
    """Why gc without --cold refuses a cooled checkpoint. Refused rather than deleted with copies
    found from its links: those files lie outside every directory the operator named, found only
    by link text anyone who can write the hot tier controls, and the other copies linking to
    them (cp -a) are only counted across the whole tier."""
    from ..manage.catalog import cold_root_of

    guess = cold_root_of(c.path)
    where = f" ({guess})" if guess else ""
    return (f"cooled: its files link into a cold tier{where}; deleting it without that tier would "
            f"orphan its cold copies. Pass --cold {guess or 'COLD_ROOT'} (or set BCP_TIERING_COLD) to "
            "delete them with it")


def _delete_all(doomed: list[Any], root: Any, hot_root: str, cold_root: str | None,
                quiet: bool) -> tuple[dict[str, int], dict[str, str]]:
    """Delete each checkpoint (checked again just before: a pin, a lease, a save to the path may
    have appeared meanwhile; only files proved to be the checkpoint's go). Returns the bytes
    freed per path and the error per path kept."""
    from ..manage.deletion import (
        DeletionRefusedError,
        delete_checkpoint,
        delete_on_storage,
        recover_deletions,
        recover_unjournaled,
    )
    from ..manage.journal import Journal, exclusive

    deleted: dict[str, int] = {}
    failed: dict[str, str] = {}
    # With a cold tier: hold its lock (a tiering pass cooling what we delete would leave cold
    # copies nobody links to) and journal each deletion there, so a crash is finished by the
    # next gc or tiering pass.
    journal = Journal(cold_root) if cold_root is not None else None
    with exclusive(cold_root) if cold_root is not None else contextlib.nullcontext():
        if journal is not None:
            recover_deletions(hot_root, cold_root, journal)
        if root.local:
            recover_unjournaled(hot_root, cold_root)  # deletions without --cold a crash cut short
        with progress("deleting", len(doomed), not quiet) as advance:
            for d in doomed:
                c = d.checkpoint
                try:
                    if root.local:
                        deleted[c.path] = delete_checkpoint(c, hot_root, cold_root, journal).bytes_freed
                    else:
                        delete_on_storage(root.storage, c)
                        deleted[c.path] = c.size
                except DeletionRefusedError as exc:
                    failed[c.path] = str(exc)
                except OSError as exc:
                    failed[c.path] = f"{exc.strerror or exc} ({exc.filename or c.url})"
                advance(1)
    return deleted, failed


def _is_plain_dir(storage: Any, path: str) -> bool:
    """A directory, not a symbolic link to one (a link leads out of the root, or round in it)."""
    from ..commit.save_lock import local_os_path

    local = local_os_path(storage, path)
    if local is not None:
        return os.path.isdir(local) and not os.path.islink(local)
    try:
        return bool(storage.is_dir(path))
    except OSError:
        return False


def _run_dirs(root: Any, checkpoints: Sequence[Any]) -> list[str]:
    """ROOT and every directory under it that may be a run: at any depth, as the catalog finds
    runs, but also one holding no checkpoint, only a killed save's staging (which the listing
    does not show as a checkpoint). Checkpoints, hidden entries and links are not entered."""
    from ..commit.protocol import LATEST_FILE

    if root.one is not None:
        return [root.path]
    skip = {c.path for c in checkpoints}
    runs, pending = [], [root.path]
    while pending:
        run = pending.pop(0)
        runs.append(run)
        try:
            entries = sorted(root.storage.list_dir(run))
        except OSError:
            continue
        pending += [posixpath.join(run, e) for e in entries
                    if not e.startswith(".") and e != LATEST_FILE and posixpath.join(run, e) not in skip
                    and _is_plain_dir(root.storage, posixpath.join(run, e))]
    return runs


def _dead_saves(root: Any, checkpoints: Sequence[Any], act: bool) -> list[tuple[str, bool]]:
    """The staging entries (``.<name>.staging-<id>``) in ROOT and the directories under it, each
    with whether it was deleted: with ``act``, those of saves whose writer is dead (its save lock
    is free, see ``protocol.reclaim_dead_saves``); a dry run deletes nothing and lists them all."""
    from ..commit.protocol import reclaim_dead_saves
    from ..commit.save_lock import STAGING_TAG
    from ..storage import CommitMode

    if root.storage.commit_mode is not CommitMode.RENAME:
        return []  # object stores: a crashed save's files go with the next save to its path
    runs = sorted(set(_run_dirs(root, checkpoints)) | {posixpath.dirname(c.path) for c in checkpoints})
    out: list[tuple[str, bool]] = []
    for run in runs:
        try:
            found = [posixpath.join(run, n) for n in root.storage.list_dir(run)
                     if n.startswith(".") and STAGING_TAG in n
                     and (root.one is None or n.startswith(f".{root.one}{STAGING_TAG}"))]
        except OSError:
            continue
        if not found:
            continue
        gone = set(reclaim_dead_saves(root.storage, run, only=root.one)) if act else set()
        out += [(p, p in gone) for p in found]
    return out


def cmd_gc(args: argparse.Namespace) -> int:
    from ..manage.deletion import reclaimable_bytes
    from .roots import list_checkpoints, open_ls_root

    if args.keep_last < 1:
        raise UsageError("--keep-last must be at least 1: the newest committed checkpoint is never deleted")
    if args.keep_every < 0:
        raise UsageError("--keep-every must be 0 (off) or positive")
    root = open_ls_root(args.root)
    if root.local:
        _check_gc_root(root.given)
    elif args.cold:
        raise UsageError(f"--cold applies to local roots (links into a cold directory), not {args.root}")
    cold_root = cold_arg(root, args.cold)
    if root.local:
        _check_tiers(root.path, cold_root)
    checkpoints = list_checkpoints(root, cold_root)
    _refuse_unmounted_cold(checkpoints, cold_root)
    # First what killed saves left (staging holds RAM on shm://): what they leave beside a
    # committed checkpoint also marks it as "a save is being written", which keeps it.
    staging = _dead_saves(root, checkpoints, args.yes)
    if any(reclaimed for _, reclaimed in staging):
        checkpoints = list_checkpoints(root, cold_root)
    decisions = plan_gc(checkpoints, keep_last=args.keep_last, keep_every=args.keep_every)
    if root.local:
        decisions = _keep_cold_copies(decisions)
    decisions.sort(key=lambda d: step_key(d.checkpoint))
    # A cooled checkpoint goes only with its cold copies: without --cold it is refused.
    refused = {d.checkpoint.path: _needs_cold(d.checkpoint) for d in decisions
               if d.delete and d.checkpoint.cold_files and cold_root is None and root.local}
    doomed = [d for d in decisions if d.delete and d.checkpoint.path not in refused]
    hot_root = root.path
    if root.local:
        hot_root = _tier_root(root.path, cold_root, [d.checkpoint.path for d in doomed])
    act = args.yes
    if act:
        deleted, failed = _delete_all(doomed, root, hot_root, cold_root, args.quiet)
        freed = sum(deleted.values())
    else:
        deleted, failed = {}, {}
        freed = sum(reclaimable_bytes(d.checkpoint.path, hot_root, cold_root) if root.local
                    else d.checkpoint.size for d in doomed)
    failed.update(refused)
    if args.json:
        print_json({
            "root": root.given, "dry_run": not act,
            "checkpoints": [{"path": d.checkpoint.path, "step": d.checkpoint.step, "size": d.checkpoint.size,
                             "action": "delete" if d.delete else "keep", "reason": d.reason,
                             "deleted": d.checkpoint.path in deleted} for d in decisions],
            "bytes_freed": freed, "failed": failed,
            "staging": [{"path": p, "reclaimed": r} for p, r in staging],
        })
    else:
        for path, reclaimed in staging:
            print(f"{'reclaimed' if reclaimed else 'staging':<13} {path:<40} " + (
                "(left by a save that is over)" if reclaimed else
                "(a save's staging: gc --yes deletes it if that save is dead)"))
        verb = "deleted" if act else "would delete"
        for d in decisions:
            c = d.checkpoint
            if not d.delete:
                label = "keep"
            elif c.path in refused:
                label = "REFUSED"
            else:
                label = verb if c.path in deleted or not act else "FAILED"
            print(f"{label:<13} {os.path.normpath(os.path.join(c.run, c.name)):<40} "
                  f"step={c.step!s:<8} {human(c.size) if c.committed and c.files else '-':>10}  ({d.reason})")
        print(f"{verb} {len(deleted) if act else len(doomed)} checkpoint(s), {human(freed)} "
              f"{'freed' if act else 'would be freed'}" + ("" if act else "; pass --yes to delete"))
        for path, err in failed.items():
            print(f"error: {path}: {err}", file=sys.stderr)
    return EXIT_FAILED if failed and act else EXIT_OK


def register(add: Adder) -> None:
    gc = add("gc", "delete old checkpoints (dry run unless --yes)",
             "Retention for a local root. Keeps, in every run: the newest --keep-last committed checkpoints "
             "(at least 1: the newest committed is never deleted; by step, or by time in a run where some "
             "checkpoint has no step), steps divisible by --keep-every (and checkpoints without a step), "
             "anything uncommitted (a save being written), pinned, being read or named by 'latest', and "
             "checkpoints whose directory holds files that are not theirs. "
             "Deletes the rest, with their cold copies. Dry run by default: prints what it would delete "
             "and the bytes it would free.")
    gc.add_argument("root", metavar="ROOT", type=location)
    gc.add_argument("--keep-last", type=int, required=True, metavar="N",
                    help="keep the newest N committed checkpoints of each run (at least 1)")
    gc.add_argument("--keep-every", type=int, default=0, metavar="K",
                    help="also keep steps divisible by K (and checkpoints saved without a step)")
    gc.add_argument("--yes", "--delete", dest="yes", action="store_true", help="really delete")
    gc.add_argument("--cold", default=os.environ.get("BCP_TIERING_COLD") or None, metavar="DIR",
                    help="the cold tier's root, whose copies are deleted too (default $BCP_TIERING_COLD)")
    gc.add_argument("--json", action="store_true", help="machine-readable output")
    gc.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    gc.set_defaults(fn=cmd_gc)
