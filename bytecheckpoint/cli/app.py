"""``bcp``: the operator's command line.

    bcp ls ROOT                 runs and checkpoints under a root
    bcp inspect PATH            what a checkpoint holds
    bcp verify PATH             re-check every checksum
    bcp export PATH OUT         Hugging Face safetensors shards
    bcp import SRC DST          a Hugging Face directory into a checkpoint
    bcp convert --from dcp|torch SRC DST, --to dcp SRC DST   PyTorch formats in and out
    bcp gc ROOT                 retention (dry run unless --yes)
    bcp tier|ingest|alerts|dashboard ...   the services (arguments passed through)

``ls`` and ``gc`` work on local roots; they reuse the tiering service's catalog, so they see
checkpoints exactly as tiering does (committed or not, hot or cold, pinned, being read).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    InvalidStorageURLError,
    NotACheckpointError,
    StorageError,
)
from ..storage.redact import redact

# Exit codes (also in docs/cli.md): scripts may rely on them.
EXIT_OK = 0
EXIT_FAILED = 1  # the check failed: verify found bad files, gc could not delete everything
EXIT_USAGE = 2  # bad command line or option value
EXIT_NOT_A_CHECKPOINT = 3  # no checkpoint there, or it never committed
EXIT_CORRUPT = 4  # metadata or storage files unreadable, unsafe or inconsistent
EXIT_EXISTS = 5  # the output exists (pass --overwrite)
EXIT_STORAGE = 6  # the storage failed (after its retries) or refused
EXIT_INTERNAL = 70  # an unexpected error (a bug): one line, the traceback with --debug
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # the reader of the output went away (| head), as for SIGPIPE

EPILOG = """exit codes:
  0  success
  1  the check failed: verify found bad files, gc could not delete a checkpoint
  2  bad command line or option value, or an unusable export/import/convert input
  3  not a checkpoint (nothing there, or a save that never committed)
  4  corrupt or unsafe checkpoint (unreadable metadata, missing or damaged file)
  5  the output already exists (pass --overwrite)
  6  storage error (failed after retries, or refused: permissions, full disk, bucket)
  70  unexpected internal error (a bug; --debug or BCP_DEBUG=1 prints the traceback)
  130 interrupted
  141 the output pipe was closed (e.g. bcp ls | head): stopped quietly
bcp tier / ingest / alerts / dashboard exit with the code of the service they run."""


class UsageError(Exception):
    """A bad option value found after parsing (exit code 2)."""


# -- output helpers ------------------------------------------------------------------------------

def _human(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def _print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


@contextmanager
def _progress(description: str, total: int | None, enabled: bool) -> Iterator[Callable[[int], None]]:
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


# -- ls / gc: the tiering catalog ------------------------------------------------------------------

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


def _step_key(c: Any) -> tuple[str, int, str]:
    """A sort key every catalog entry has, whatever its step (an odd one sorts first)."""
    return (str(c.run), c.step if isinstance(c.step, int) else -1, str(c.name))


def _layout_text(meta: Any) -> str:
    layout = meta.layout or {}
    parts = [f"{meta.world_size} rank{'s' if meta.world_size != 1 else ''}"]
    for k, v in sorted(layout.items()):
        if k != "world_size":
            parts.append(f"{k}={v}")
    return " ".join(parts)


def _ls_rows(root: Any, checkpoints: list[Any], now: float) -> list[dict[str, Any]]:
    rows = []
    for c in sorted(checkpoints, key=_step_key):
        row: dict[str, Any] = {
            "run": c.run, "name": c.name, "path": c.path, "step": c.step, "committed": c.committed,
            "size": c.size, "files": max(len(c.files) - 1, 0) if c.committed else 0,
            "framework": None, "world_size": None, "layout": None,
            "tier": ("staging" if c.staging else c.state) if not c.committed else c.tier,
            "age_s": round(now - c.modified, 3), "latest": c.latest, "pinned": c.pinned,
            "being_read": c.being_read, "problem": c.problem, "abandoned": c.abandoned,
        }
        if c.committed:
            try:
                meta = root.metadata(c)
                row.update(framework=meta.framework, world_size=meta.world_size, layout=meta.layout,
                           layout_text=_layout_text(meta))
            except (OSError, CheckpointError, ValueError, TypeError) as exc:
                row.update(committed=False, tier="unreadable", error=str(exc))
        rows.append(row)
    return rows


def cmd_ls(args: argparse.Namespace) -> int:
    from .roots import list_checkpoints, open_ls_root

    now = time.time()
    root = open_ls_root(args.root)
    rows = _ls_rows(root, list_checkpoints(root, _cold_arg(root, args.cold)), now)
    if args.json:
        _print_json({"root": root.given, "checkpoints": rows})
        return EXIT_OK
    if not rows:
        print(f"no checkpoints under {root.given}")
        return EXIT_OK
    table = []
    for r in rows:
        flags = ",".join(f for f, on in (("latest", r["latest"]), ("abandoned", r["abandoned"]),
                                         ("pinned", r["pinned"]),
                                         ("reading", r["being_read"]), ("unclassified", r["problem"]))
                         if on)
        table.append([os.path.normpath(os.path.join(r["run"], r["name"])),
                      "-" if r["step"] is None else r["step"], _human(r["size"]) if r["committed"] else "-",
                      r["files"] or "-", r.get("layout_text") or "-", r["framework"] or "-",
                      "yes" if r["committed"] else "no", r["tier"], _age(r["age_s"]), flags])
    print(_table(["CHECKPOINT", "STEP", "SIZE", "FILES", "WORLD", "FRAMEWORK", "COMMITTED", "TIER", "AGE",
                  "FLAGS"], table))
    for r in rows:
        if r["problem"]:
            print(f"note: {os.path.normpath(os.path.join(r['run'], r['name']))}: {r['problem']}; gc and "
                  "tiering leave it alone", file=sys.stderr)
    return EXIT_OK


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


def _cold_arg(root: Any, cold: str | None) -> str | None:
    """--cold (or $BCP_TIERING_COLD) as an absolute path; it only applies to a local root."""
    if not cold or not root.local:
        return None
    cold_root = os.path.abspath(cold)
    if not os.path.isdir(cold_root):
        raise UsageError(f"--cold {cold_root}: no such directory (is the cold tier mounted?)")
    return cold_root


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
        with _progress("deleting", len(doomed), not quiet) as advance:
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
    cold_root = _cold_arg(root, args.cold)
    decisions = plan_gc(list_checkpoints(root, cold_root), keep_last=args.keep_last,
                        keep_every=args.keep_every)
    decisions.sort(key=lambda d: _step_key(d.checkpoint))
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
        _print_json({
            "root": root.given, "dry_run": not act,
            "checkpoints": [{"path": d.checkpoint.path, "step": d.checkpoint.step, "size": d.checkpoint.size,
                             "action": "delete" if d.delete else "keep", "reason": d.reason,
                             "deleted": d.checkpoint.path in deleted} for d in decisions],
            "bytes_freed": freed, "failed": failed,
        })
    else:
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
                  f"step={c.step!s:<8} {_human(c.size) if c.committed else '-':>10}  ({d.reason})")
        print(f"{verb} {len(deleted) if act else len(doomed)} checkpoint(s), {_human(freed)} "
              f"{'freed' if act else 'would be freed'}" + ("" if act else "; pass --yes to delete"))
        for path, err in failed.items():
            print(f"error: {path}: {err}", file=sys.stderr)
    return EXIT_FAILED if failed and act else EXIT_OK


# -- inspect / verify ------------------------------------------------------------------------------

def _inspect_doc(url: str) -> dict[str, Any]:
    import numpy as np

    from ..commit.integrity import read_metadata

    storage, path = _resolve(url)
    meta = read_metadata(storage, path)
    counts = np.bincount(meta.boxes.tensor, minlength=len(meta.tensors)) if len(meta.tensors) else []
    tensors = [{"key": t.key, "shape": list(t.shape), "dtype": t.dtype, "boxes": int(n),
                "bytes": t.nbytes} for t, n in zip(meta.tensors, counts)]
    groups: dict[str, dict[str, int]] = {}
    for t in tensors:
        g = groups.setdefault(t["key"].split("/", 1)[0], {"tensors": 0, "bytes": 0})
        g["tensors"] += 1
        g["bytes"] += t["bytes"]
    return {
        "path": storage.url(path),
        "step": meta.step,
        "framework": meta.framework,
        "world_size": meta.world_size,
        "layout": meta.layout,
        "created_at": meta.created_at,
        "library_version": meta.library_version,
        "files": [{"name": f.name, "size": f.size, "rank": f.rank, "kind": f.kind} for f in meta.files],
        "total_bytes": meta.total_bytes,
        "groups": groups,
        "tensors": tensors,
        "boxes": len(meta.boxes),
        "objects": [{"key": o.key, "rank": o.rank, "bytes": o.bytes.byte_length} for o in meta.objects],
        "loader": meta.loader,
        "user_metadata": meta.user_metadata,
    }


def _when(timestamp: Any) -> str:
    """A metadata timestamp as a UTC date, or what is wrong with it (it may hold anything)."""
    if not timestamp:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(timestamp)))
    except (OverflowError, OSError, ValueError, TypeError):
        return f"invalid ({str(timestamp)[:40]})"


def cmd_inspect(args: argparse.Namespace) -> int:
    doc = _inspect_doc(args.path)
    if args.json:
        _print_json(doc)
        return EXIT_OK
    created = _when(doc["created_at"])
    print(f"checkpoint  {doc['path']}")
    print(f"step        {doc['step']}")
    print(f"framework   {doc['framework']}   saved by {doc['world_size']} rank(s)   "
          f"layout {json.dumps(doc['layout'])}")
    print(f"created     {created}   library {doc['library_version']}")
    print(f"size        {_human(doc['total_bytes'])} in {len(doc['files'])} files, "
          f"{len(doc['tensors'])} tensors, {doc['boxes']} boxes")
    print("groups      " + ", ".join(f"{g}: {v['tensors']} tensors, {_human(v['bytes'])}"
                                     for g, v in doc["groups"].items()))
    print()
    shown = doc["tensors"] if args.all else doc["tensors"][: args.max_rows]
    print(_table(["TENSOR", "SHAPE", "DTYPE", "BOXES"],
                 [[t["key"], "x".join(map(str, t["shape"])) or "()", t["dtype"], t["boxes"]] for t in shown]))
    if len(shown) < len(doc["tensors"]):
        print(f"... {len(doc['tensors']) - len(shown)} more (pass --all or --json)")
    print()
    per_rank = [o for o in doc["objects"] if o["rank"] is not None]
    shared = [o for o in doc["objects"] if o["rank"] is None]
    extra_keys = sorted({o["key"] for o in per_rank})
    print(f"extra state {len(extra_keys)} per-rank key(s): {', '.join(extra_keys) or '-'}; "
          f"{len(shared)} shared object(s)")
    loader = doc["loader"]
    print(f"dataloader  {len(loader)} entr{'y' if len(loader) == 1 else 'ies'}"
          + (f": {json.dumps(loader[0], default=str)[:200]}" if loader else ""))
    loader_objs = sorted({o["key"].split("/", 1)[0] for o in shared if "/" in o["key"]}
                         - {"model", "optimizer"})
    if loader_objs:
        print(f"            reshardable state: {', '.join(loader_objs)}")
    user = json.dumps(doc["user_metadata"], default=str)[:2000] if doc["user_metadata"] else "-"
    print(f"user meta   {user}")
    return EXIT_OK


def _resolve(url: str) -> tuple[Any, str]:
    """The checkpoint at ``url``; a local path that is a file (or a device) is no checkpoint."""
    from ..commit.integrity import resolve
    from ..storage import split_url

    scheme, local = split_url(url)
    if scheme == "file" and os.path.lexists(local) and not os.path.isdir(local):
        raise NotACheckpointError(f"{url} is a file, not a checkpoint directory (a checkpoint is a "
                                  "directory holding metadata.msgpack, or a root with a 'latest' pointer)")
    return resolve(url)


def cmd_verify(args: argparse.Namespace) -> int:
    from ..commit.integrity import read_metadata, verify_files

    storage, path = _resolve(args.path)
    total = sum(f.size for f in read_metadata(storage, path).files)
    t0 = time.perf_counter()
    with _progress("verifying", total, not args.quiet) as advance:
        url, problems = verify_files(args.path, threads=args.threads, progress=advance)
    seconds = time.perf_counter() - t0
    bad = sorted({p.file for p in problems})
    if args.json:
        _print_json({"path": url, "ok": not problems, "bad_files": bad,
                     "problems": [p.message for p in problems], "bytes": total, "seconds": round(seconds, 3)})
    elif problems:
        for p in problems:
            print(f"BAD  {p.file}: {p.message}")
        print(f"{url}: {len(bad)} bad file(s): {', '.join(bad)}", file=sys.stderr)
    else:
        print(f"OK   {url}: every checksum matches ({_human(total)} in {seconds:.2f} s)")
    return EXIT_FAILED if problems else EXIT_OK


# -- export / import -------------------------------------------------------------------------------

def _names(args: argparse.Namespace) -> Any:
    from ..tools.export import NameMap

    return NameMap.parse(args.strip_prefix or (), args.rename or ())


def _check_export_target(url: str, out: str) -> None:
    """OUT must not be the checkpoint, inside it, or a directory holding it: replacing OUT
    (--overwrite) would delete the checkpoint, and writing into it would change it."""
    storage, path = _resolve(url)
    if storage.scheme != "file":
        return
    ckpt, target = os.path.realpath(path), os.path.realpath(out)
    if os.path.commonpath([ckpt, target]) in (ckpt, target):
        raise UsageError(f"OUT {out} {'is' if ckpt == target else 'overlaps'} the checkpoint {ckpt}: "
                         "choose a directory outside it")


def cmd_export(args: argparse.Namespace) -> int:
    from ..tools.export import parse_dtype, parse_size, plan_export

    if args.format != "safetensors":
        raise UsageError(f"--format {args.format!r}: only safetensors is supported")
    try:
        from ..tools.export import export_safetensors
        limit = parse_size(args.max_shard_size)
        dtype = parse_dtype(args.dtype)
        names = _names(args)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    _check_export_target(args.path, args.out)
    _, _, model, optim = plan_export(args.path, model_key=args.model_key,
                                     include_optimizer=args.include_optimizer, names=names, dtype=dtype)
    total = sum(it.out_bytes for it in model + optim)
    tied = None if args.tied is None else tuple(t for t in args.tied if t)
    with _progress("exporting", total, not args.quiet) as advance:
        result = export_safetensors(
            args.path, args.out, max_shard_bytes=limit, dtype=dtype, names=names,
            include_optimizer=args.include_optimizer, model_key=args.model_key, config=args.config,
            tied=tied, overwrite=args.overwrite, progress=lambda _name, n: advance(n))
    if args.json:
        _print_json({"out": result.out_dir, "files": result.files, "tensors": result.tensors,
                     "bytes": result.bytes, "tied": result.tied, "config": result.config_written})
        return EXIT_OK
    print(f"exported {result.tensors} tensors ({_human(result.bytes)}) to {result.out_dir}")
    for f in result.files:
        print(f"  {f}")
    for dropped, kept in result.tied.items():
        print(f"  tied: {dropped} = {kept} (written once)")
    if not result.config_written:
        print("note: no config.json written (the checkpoint's user metadata has no 'hf_config'; "
              "pass --config)", file=sys.stderr)
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    from ..tools.export import ExportError, import_safetensors

    try:
        names = _names(args)
        tie = None
        if args.tie:
            tie = {}
            for pair in args.tie:
                if "=" not in pair:
                    raise ExportError(f"--tie {pair!r} must look like NAME=SOURCE")
                k, v = pair.split("=", 1)
                tie[k] = v
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    with _progress("reading", None, not args.quiet) as advance:
        result = import_safetensors(args.src, args.dst, model_key=args.model_key, names=names, tie=tie,
                                    step=args.step, overwrite=args.overwrite,
                                    progress=lambda _name, n: advance(n))
    if args.json:
        _print_json({"path": result.path, "tensors": result.tensors, "bytes": result.bytes,
                     "tied": result.tied})
    else:
        print(f"imported {result.tensors} tensors ({_human(result.bytes)}) into {result.path}")
        for k, v in result.tied.items():
            print(f"  tied: {k} = {v}")
    return EXIT_OK


# -- convert ---------------------------------------------------------------------------------------

def cmd_convert(args: argparse.Namespace) -> int:
    from ..tools import convert
    from ..tools.export import parse_size

    if (args.from_ is None) == (args.to is None):
        raise UsageError("give exactly one of --from dcp|torch (into bytecheckpoint) or --to dcp (out of it)")
    try:
        cap = parse_size(args.max_memory)
    except CheckpointError as exc:
        raise UsageError(f"--max-memory: {exc}") from None
    if cap < convert.MIN_MEMORY:
        raise UsageError(f"--max-memory {args.max_memory}: at least 1MiB")
    fn = {"dcp": convert.from_dcp, "torch": convert.from_torch}[args.from_] if args.from_ else convert.to_dcp
    with _progress("converting", None, not args.quiet) as advance:
        result = fn(args.src, args.dst, max_memory=cap, overwrite=args.overwrite, progress=advance)
    if args.json:
        _print_json({"path": result.path, "tensors": result.tensors, "bytes": result.bytes,
                     "skipped": result.skipped})
        return EXIT_OK
    print(f"converted {result.tensors} tensors ({_human(result.bytes)}) into {result.path}")
    for s in result.skipped:
        print(f"  skipped: {s}", file=sys.stderr)
    return EXIT_OK


# -- delegation to the services --------------------------------------------------------------------

def _delegate(module: str) -> Callable[[argparse.Namespace], int]:
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


# -- parser ----------------------------------------------------------------------------------------

def _count(minimum: int) -> Callable[[str], int]:
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

    ls = add("ls", "list runs and checkpoints under a local root",
             "List every checkpoint under ROOT (runs at any depth): step, size, files, saving world and "
             "layout, framework, committed or not, tier (hot / cold / partial / staging), age, and flags "
             "(latest, pinned, being read).")
    ls.add_argument("root", metavar="ROOT")
    ls.add_argument("--cold", default=os.environ.get("BCP_TIERING_COLD") or None, metavar="DIR",
                    help="the cold tier's root, to tell cold checkpoints apart (default $BCP_TIERING_COLD)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_ls)

    ins = add("inspect", "summarize a checkpoint's metadata",
              "Summarize a checkpoint from its metadata alone (no tensor bytes are read, nothing is "
              "unpickled): tensors (key, global shape, dtype, number of boxes), the saving layout, "
              "files, dataloader and extra state, user metadata. PATH is a checkpoint or a root with a "
              "'latest' pointer; any storage URL works.")
    ins.add_argument("path", metavar="PATH")
    ins.add_argument("--json", action="store_true", help="machine-readable output (every tensor)")
    ins.add_argument("--all", action="store_true", help="list every tensor")
    ins.add_argument("--max-rows", type=_count(0), default=200,
                     help="tensors listed without --all (default 200)")
    ins.set_defaults(fn=cmd_inspect)

    ver = add("verify", "re-check every checksum of a checkpoint",
              "Read every stored piece back and check its checksums, in parallel. Prints each bad file and "
              "exits 1 when any is found (4 when the metadata itself is unreadable).")
    ver.add_argument("path", metavar="PATH")
    ver.add_argument("--threads", type=_count(1), default=8, help="parallel readers (default 8)")
    ver.add_argument("--json", action="store_true", help="machine-readable output")
    ver.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ver.set_defaults(fn=cmd_verify)

    ex = add("export", "write a checkpoint as Hugging Face safetensors shards",
             "Merge a checkpoint's shards into full tensors and write OUT/model-0000k-of-0000n.safetensors "
             "with model.safetensors.index.json (and config.json), which transformers' from_pretrained "
             "loads. Streams: about one output shard is in memory at a time. Optimizer state "
             "(--include-optimizer) goes to optimizer-*.safetensors with its own index, named "
             "<parameter>.<state>, e.g. transformer.h.0.attn.c_attn.weight.exp_avg.")
    ex.add_argument("path", metavar="PATH", help="checkpoint, or a root with a 'latest' pointer")
    ex.add_argument("out", metavar="OUT", help="output directory (created; must be empty unless --overwrite)")
    ex.add_argument("--format", default="safetensors", choices=["safetensors"], help="output format")
    ex.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                    help="largest output file, e.g. 2GB, 500MB, 1GiB (default 5GB); a bigger tensor gets a "
                         "file of its own")
    ex.add_argument("--dtype", default=None, metavar="DTYPE",
                    help="convert floating tensors: fp32, fp16, bf16, fp64 (default: as saved)")
    ex.add_argument("--strip-prefix", action="append", metavar="PREFIX",
                    help="remove PREFIX from names that start with it (repeatable; first match wins)")
    ex.add_argument("--rename", action="append", metavar="OLD=NEW",
                    help="regular-expression substitution on names, after --strip-prefix "
                         "(repeatable, applied in order)")
    ex.add_argument("--include-optimizer", action="store_true", help="also write optimizer state")
    ex.add_argument("--model-key", default="model", help="the state key of the model (default 'model')")
    ex.add_argument("--config", default=None, metavar="FILE",
                    help="config.json to copy in (default: the checkpoint's user metadata 'hf_config')")
    ex.add_argument("--tied", action="append", metavar="NAME",
                    help="a name written once when bit-identical to another tensor (repeatable; "
                         "default lm_head.weight unless the config sets tie_word_embeddings false; "
                         "--tied '' for none)")
    ex.add_argument("--overwrite", action="store_true", help="replace OUT")
    ex.add_argument("--json", action="store_true", help="machine-readable summary")
    ex.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    ex.set_defaults(fn=cmd_export)

    im = add("import", "write a Hugging Face safetensors directory as a checkpoint",
             "Read SRC (model.safetensors.index.json and its shards, or one model.safetensors; config.json "
             "when present) without unpickling anything, and save it at DST as a checkpoint of full "
             "tensors under the state key 'model', which bytecheckpoint.load reshards into any layout. "
             "The whole model is held in memory once.")
    im.add_argument("src", metavar="SRC", help="Hugging Face model directory")
    im.add_argument("dst", metavar="DST", help="checkpoint path to create (any storage URL)")
    im.add_argument("--model-key", default="model",
                    help="state key to store the tensors under (default 'model')")
    im.add_argument("--strip-prefix", action="append", metavar="PREFIX", help="as for export")
    im.add_argument("--rename", action="append", metavar="OLD=NEW", help="as for export")
    im.add_argument("--tie", action="append", metavar="NAME=SOURCE",
                    help="add NAME as a copy of SOURCE (default: the pairs the export recorded)")
    im.add_argument("--step", type=_count(0), default=None, help="step recorded in the checkpoint")
    im.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    im.add_argument("--json", action="store_true", help="machine-readable summary")
    im.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    im.set_defaults(fn=cmd_import)

    cv = add("convert", "convert PyTorch DCP / torch.save checkpoints to bytecheckpoint and back",
             "--from dcp SRC DST: a DCP directory (.metadata + __N_M.distcp) into a checkpoint. "
             "--from torch FILE DST: a torch.save state dict (read with weights_only=True; anything "
             "else is refused). --to dcp SRC DST: a checkpoint into a DCP directory that "
             "torch.distributed.checkpoint.load reads. Into bytecheckpoint the bytes stream in blocks "
             "under --max-memory; out of it tensors are loaded whole in batches under it (one larger "
             "tensor is a batch of its own). Nothing is unpickled by the standard unpickler.")
    way = cv.add_mutually_exclusive_group(required=True)
    way.add_argument("--from", dest="from_", choices=["dcp", "torch"], help="the source format")
    way.add_argument("--to", choices=["dcp"], help="the output format (the source is a checkpoint)")
    cv.add_argument("src", metavar="SRC")
    cv.add_argument("dst", metavar="DST", help="output (created; an existing one needs --overwrite)")
    cv.add_argument("--max-memory", default="1GiB", metavar="BYTES",
                    help="memory cap for tensor data, e.g. 16MiB, 2GB (default 1GiB; at least 1MiB)")
    cv.add_argument("--overwrite", action="store_true", help="replace DST")
    cv.add_argument("--json", action="store_true", help="machine-readable summary")
    cv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    cv.set_defaults(fn=cmd_convert)

    gc = add("gc", "delete old checkpoints (dry run unless --yes)",
             "Retention for a local root. Keeps, in every run: the newest --keep-last committed checkpoints "
             "(at least 1: the newest committed is never deleted), steps divisible by --keep-every, and "
             "anything uncommitted (a save being written), pinned, being read or named by 'latest'. "
             "Deletes the rest, with their cold copies. Dry run by default: prints what it would delete "
             "and the bytes it would free.")
    gc.add_argument("root", metavar="ROOT")
    gc.add_argument("--keep-last", type=int, required=True, metavar="N",
                    help="keep the newest N committed checkpoints of each run (at least 1)")
    gc.add_argument("--keep-every", type=int, default=0, metavar="K",
                    help="also keep steps divisible by K")
    gc.add_argument("--yes", "--delete", dest="yes", action="store_true", help="really delete")
    gc.add_argument("--cold", default=os.environ.get("BCP_TIERING_COLD") or None, metavar="DIR",
                    help="the cold tier's root, whose copies are deleted too (default $BCP_TIERING_COLD)")
    gc.add_argument("--json", action="store_true", help="machine-readable output")
    gc.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    gc.set_defaults(fn=cmd_gc)

    for name, (module, help_) in SERVICES.items():
        s = sub.add_parser(name, help=help_, add_help=False,
                           description=f"{help_}; every argument is passed through, so "
                                       f"'bcp {name} --help' shows the service's own options.")
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(fn=_delegate(module))
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
    if isinstance(exc, NotACheckpointError):
        return f"not a checkpoint: {exc}", EXIT_NOT_A_CHECKPOINT
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
        args = argparse.Namespace(command=argv[0], rest=argv[1:], fn=_delegate(SERVICES[argv[0]][0]))
    else:
        try:
            args = parser.parse_args(argv)
        except BrokenPipeError:
            return _quiet_broken_pipe()
    try:
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

