"""The event contract between the code that emits spans and the tables and alert rules that read them.

Everything here is data: the library (``bytecheckpoint/engine``), the storage layer and the
ingester agree on these names. The event schema table of docs/telemetry.md says the same in prose.

Event fields (one flat JSON object per finished span)::

    event_id      32 hex chars, unique per span (the dedup key downstream)
    name          span name, e.g. "save.write" (see the phase lists below)
    ts            start time, seconds since the epoch (float)
    duration_s    wall time of the span
    outcome       "ok" | "error"
    error         "ExcType: message" when outcome is "error"
    parent_id     event_id of the enclosing span in the same thread / task, or None
    checkpoint    the checkpoint this span worked on: the ``path`` of the enclosing "save" / "load"
                  span (inherited by child spans, and by spans in worker threads while it is open)
    checkpoint_op "save" | "load" for spans under a checkpoint, else None
    call_id       32 hex chars, made when a "save" / "load" call starts and inherited like
                  ``checkpoint`` (an async save's background work carries its save's): which call
                  of this rank the span belongs to; None outside a call. Events of releases
                  before it lack the field (the dashboard then falls back to timing)
    job run step rank world_size dp tp pp host pid      from set_context()
    bytes path backend op attempt phase                 optional, from span fields
    attrs         every other span field, as a JSON object
"""

from __future__ import annotations

# Spans that open a checkpoint scope: their ``path`` (or an explicit ``checkpoint=``) becomes
# the ``checkpoint`` of every span inside them.
SCOPE_SPANS: tuple[str, ...] = ("save", "load")

# Phase spans of a save, in pipeline order. "save" itself is the whole call (it includes the
# time a rank waits for the others), so slow-rank rules look at the phases only.
SAVE_PHASES: tuple[str, ...] = (
    "save.plan",  # local + global planning (collectives on the control group)
    "save.loader",  # dataloader-state collection
    "save.stage",  # D2H copy into the staging buffer pool
    "save.serialize",  # tensors -> file bytes (headers, checksums)
    "save.write",  # write / upload of one storage file; bytes = file size
    "save.commit",  # metadata write + commit rename (coordinator), barrier (others)
)

LOAD_PHASES: tuple[str, ...] = (
    "load.metadata",  # read and validate the global metadata
    "load.plan",  # intersect target boxes with saved boxes, assign reads
    "load.read",  # one ranged read; bytes = bytes read
    "load.exchange",  # send / receive pieces read by another rank
    "load.h2d",  # host -> device copy
    "load.apply",  # copy into the state in place
    "load.loader",  # dataloader-state resharding and restore
    "load.barrier",  # final agreement that every rank succeeded
)

PHASES: tuple[str, ...] = SAVE_PHASES + LOAD_PHASES

# One span per storage operation, named IO_SPAN_PREFIX + op (e.g. "storage.write"), with
# fields op, backend (URL scheme), path, bytes, attempt (1 for the first try). These go to
# the io_ops table as well as events.
IO_SPAN_PREFIX = "storage."
IO_OPS: tuple[str, ...] = (
    "write", "read", "size", "list", "exists", "rename", "exchange", "delete", "makedirs", "concat",
)

# Phases whose bytes / duration is a throughput (the low-throughput rule's default).
THROUGHPUT_PHASES: tuple[str, ...] = ("save.write", "load.read")

# Marks a committed checkpoint: a "save.commit" span with outcome "ok".
COMMIT_SPAN = "save.commit"


def is_io_event(event: dict) -> bool:
    """True for storage-operation events (they also go to the io_ops table)."""
    name = event.get("name")
    return isinstance(name, str) and name.startswith(IO_SPAN_PREFIX)
