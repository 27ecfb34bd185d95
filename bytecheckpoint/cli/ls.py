"""``bcp ls ROOT``: every checkpoint under a root (local or any storage URL), as the catalog sees it."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from ..errors import CheckpointError
from .common import (
    EXIT_OK,
    Adder,
    age,
    cold_arg,
    human,
    location,
    print_json,
    step_key,
    table,
)


def _layout_text(meta: Any) -> str:
    layout = meta.layout or {}
    parts = [f"{meta.world_size} rank{'s' if meta.world_size != 1 else ''}"]
    for k, v in sorted(layout.items()):
        if k != "world_size":
            parts.append(f"{k}={v}")
    return " ".join(parts)


def _ls_rows(root: Any, checkpoints: list[Any], now: float) -> list[dict[str, Any]]:
    rows = []
    for c in sorted(checkpoints, key=step_key):
        row: dict[str, Any] = {
            "run": c.run, "name": c.name, "path": c.path, "step": c.step, "committed": c.committed,
            "size": c.size, "files": max(len(c.files) - 1, 0) if c.committed else 0,
            "framework": None, "world_size": None, "layout": None,
            "tier": ("staging" if c.staging else c.state) if not c.committed else c.tier,
            "age_s": round(now - c.modified, 3), "latest": c.latest, "pinned": c.pinned,
            "being_read": c.being_read, "problem": c.problem, "abandoned": c.abandoned,
            "unreachable": c.unreachable,
        }
        if c.newer_format:  # committed by a newer release: not a crashed save
            row.update(committed=True, newer_format=True, files=0)
        if c.unreachable is not None:  # committed, its bytes in a cold tier that is not mounted
            row.update(tier=c.state, size=c.size if c.files else None)  # None: unknown
        if c.committed and c.files:  # no files: its metadata is in that cold tier
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
    rows = _ls_rows(root, list_checkpoints(root, cold_arg(root, args.cold)), now)
    if args.json:
        print_json({"root": root.given, "checkpoints": rows})
        return EXIT_OK
    if not rows:
        print(f"no checkpoints under {root.given}")
        return EXIT_OK
    cells = []
    for r in rows:
        flags = ",".join(f for f, on in (("latest", r["latest"]), ("abandoned", r["abandoned"]),
                                         ("pinned", r["pinned"]), ("reading", r["being_read"]),
                                         ("unclassified", r["problem"] and not r["unreachable"]))
                         if on)
        sized = r["committed"] and not r.get("newer_format") and r["size"] is not None
        cells.append([os.path.normpath(os.path.join(r["run"], r["name"])),
                      "-" if r["step"] is None else r["step"],
                      human(r["size"]) if sized else "-",
                      r["files"] or "-", r.get("layout_text") or "-", r["framework"] or "-",
                      "yes" if r["committed"] else "no", r["tier"], age(r["age_s"]), flags])
    print(table(["CHECKPOINT", "STEP", "SIZE", "FILES", "WORLD", "FRAMEWORK", "COMMITTED", "TIER", "AGE",
                  "FLAGS"], cells))
    for r in rows:
        if r["problem"]:
            print(f"note: {os.path.normpath(os.path.join(r['run'], r['name']))}: {r['problem']}; gc and "
                  "tiering leave it alone", file=sys.stderr)
    return EXIT_OK


def register(add: Adder) -> None:
    ls = add("ls", "list runs and checkpoints under a local root",
             "List every checkpoint under ROOT (runs at any depth): step, size, files, saving world and "
             "layout, framework, committed or not, tier (hot / cold / partial / staging), age, and flags "
             "(latest, pinned, being read).")
    ls.add_argument("root", metavar="ROOT", type=location)
    ls.add_argument("--cold", default=os.environ.get("BCP_TIERING_COLD") or None, metavar="DIR",
                    help="the cold tier's root, to tell cold checkpoints apart (default $BCP_TIERING_COLD)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=cmd_ls)
