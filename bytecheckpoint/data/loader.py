"""A stateful token-buffer loader for language-model pretraining that reshards.

Each data-parallel rank runs ``workers`` reader processes (see ``worker.py``). A batch is
``batch_size`` windows of ``context + 1`` tokens, taken from the workers in turn. Its state
is a replicated part (sources, ratios, seed, worker count, read frontiers) and a sharded
part per data-parallel rank (each worker's token buffer, read cursors and RNG).

In a checkpoint (``state["dataloader"] = loader``) the replicated part is saved once and
the shard of DP rank ``r`` of ``D`` under ``shard/D/r``, written once per DP group (TP and
PP peers hold identical copies). Loading with the same DP size gives each rank its shard
back exactly; with another DP size, all shards are merged and re-split so that no sample
is lost and none is read twice.

With ``checkpoint_every=K``, workers prepare their state during the batch before every
K-th batch, so collecting it when the checkpoint is taken costs almost nothing.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import numpy as np
import torch

from telemetry import span

from ..errors import (
    CorruptCheckpointError,
    DataLoaderError,
    InvalidArgumentError,
    StagingError,
    StateMismatchError,
)
from .source import TokenSource
from .streams import (
    Layout,
    Pieces,
    StreamState,
    initial_states,
    reshard,
    source_fingerprint,
    validate_layout,
    validate_shard,
)
from .worker import run_worker

REPLICATED = "replicated"


@dataclass
class TokenBatch:
    tokens: torch.Tensor  # (batch, context + 1) int64; inputs = [:, :-1], targets = [:, 1:]
    valid: list[int]  # real tokens per row (< context + 1 only at the very end of the data)
    pieces: list[Pieces]  # per row: which samples' tokens it holds

    @property
    def inputs(self) -> torch.Tensor:
        return self.tokens[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.tokens[:, 1:]


def _dp_default() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# Loaders with started readers, closed at interpreter exit (see _close_open_loaders).
_OPEN: weakref.WeakSet[TokenLoader] = weakref.WeakSet()
_exit_hooked = False


def _close_open_loaders() -> None:
    """Stop the readers of loaders still open at interpreter exit.

    Registered after ``multiprocessing.util`` (imported above), so it runs before
    multiprocessing's own exit function, which ends daemon children with SIGTERM and joins
    them. A forked reader inherits the parent's Python SIGTERM handler (a checkpoint
    manager's preemption handler, a launcher's), ignores that SIGTERM, and the join would
    wait forever; ``close()`` asks the readers to stop and kills any that do not.
    """
    for loader in list(_OPEN):
        try:
            loader.close()
        except Exception:  # noqa: BLE001 - exiting: the other loaders must still close
            pass


def _hook_exit() -> None:
    global _exit_hooked
    if not _exit_hooked:
        atexit.register(_close_open_loaders)
        _exit_hooked = True


class TokenLoader:
    """Packs samples from weighted sources into fixed windows, with reshardable state.

    Args:
        sources: token source directories (``write_source``).
        ratios: sampling weight per source (default: equal).
        context: model context; windows hold ``context + 1`` tokens.
        batch_size: windows per batch on this rank.
        workers: reader processes per data-parallel rank.
        dp_rank, dp_size: this rank's data-parallel coordinate (default: the global rank and
            world size, i.e. pure data parallelism; pass them under TP or PP).
        buffer_tokens: tokens each worker reads ahead (its token buffer).
        checkpoint_every: batches between checkpoints, enabling state prefetch.
        state_timeout_s: the longest a checkpoint waits for the readers' state before it
            raises ``StagingError`` (a reader that does not answer never hangs a save).
        reader_timeout_s: the longest a batch waits on a reader that sends nothing at all
            (no window, no state) before ``next()`` raises ``DataLoaderError``; the time
            restarts with every reply, so a slow but live reader never trips it.
    """

    def __init__(self, sources: Sequence[str], ratios: Sequence[float] | None = None, *, context: int,
                 batch_size: int, workers: int = 2, dp_rank: int | None = None,
                 dp_size: int | None = None, seed: int = 0, buffer_tokens: int = 4096,
                 prefetch: int = 4, checkpoint_every: int | None = None, pad_id: int = 0,
                 start_method: str = "fork", state_timeout_s: float = 120.0,
                 reader_timeout_s: float = 600.0) -> None:
        for name, value in (("context", context), ("batch_size", batch_size), ("workers", workers),
                            ("prefetch", prefetch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"TokenLoader {name} must be a whole number >= 1, not {value!r}")
        if checkpoint_every is not None and (not isinstance(checkpoint_every, int) or checkpoint_every < 1):
            raise InvalidArgumentError(
                f"TokenLoader checkpoint_every must be None or a whole number >= 1, not {checkpoint_every!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InvalidArgumentError(f"TokenLoader seed must be a whole number >= 0, not {seed!r}")
        if isinstance(pad_id, bool) or not isinstance(pad_id, int) or not -(1 << 31) <= pad_id < 1 << 31:
            raise InvalidArgumentError(f"TokenLoader pad_id must be an int32 token id, not {pad_id!r}")
        for name, limit in (("state_timeout_s", state_timeout_s), ("reader_timeout_s", reader_timeout_s)):
            if not limit > 0:
                raise InvalidArgumentError(f"TokenLoader {name} must be > 0, not {limit!r}")
        if dp_rank is None or dp_size is None:
            dp_rank, dp_size = _dp_default()
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_size {dp_size}")
        ratios = list(ratios) if ratios is not None else [1.0] * len(sources)
        if len(ratios) != len(sources) or any(r <= 0 for r in ratios):
            raise ValueError("ratios must give one positive weight per source")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.batch_size = batch_size
        self.prefetch = prefetch
        self.checkpoint_every = checkpoint_every
        self.start_method = start_method
        self.state_timeout_s = float(state_timeout_s)
        self.reader_timeout_s = float(reader_timeout_s)
        self._opened = [TokenSource(p) for p in sources]  # also validates the sources
        self._sizes = [len(t) for t in self._opened]
        self.layout = Layout(list(sources), ratios, seed, context + 1, workers, dp_size, buffer_tokens,
                             pad_id)
        self._states = self._own(initial_states(self.layout))
        self._rotation = {"next": 0, "finished": [False] * workers}
        self.batches = 0
        self.last_collect_s = 0.0
        self.last_collect_prepared = False  # whether the last collection was prefetched
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._requested: list[int] = []  # per worker: the tag of its unused prefetch request
        self._sent: list[int] = []  # per worker: "next" requests sent
        self._expect: list[int] = []  # per worker: "next" requests after which it prefetches
        self._failed: str | None = None
        self._heard: list[float] = []  # per worker: monotonic time of its last reply
        self._stalled: set[int] = set()  # workers given up on: killed at close, not awaited
        # batches read when close() stopped started readers: their positions are gone, and
        # self._states still says where the loader started (None: nothing was lost)
        self._closed_after: int | None = None

    # -- workers --------------------------------------------------------------------
    def _own(self, states: list[StreamState]) -> list[StreamState]:
        w = self.layout.workers
        return [s for s in states if s.stream // w == self.dp_rank]

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        self._windows: list[queue.Queue] = []
        self._prepared: list[dict[int, Any]] = []
        self._state_ready = threading.Condition()
        for state in self._states:
            parent, child = ctx.Pipe()
            # a forked child closes its copies of the loader's pipe ends (so it sees EOF
            # when the loader dies); other start methods do not inherit them
            inherited = [*self._conns, parent] if self.start_method == "fork" else []
            proc = ctx.Process(target=run_worker, daemon=True,
                               args=(child, self.layout.to_dict(), state.to_dict(), self.prefetch,
                                     inherited))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            self._windows.append(queue.Queue())
            self._prepared.append({})
            self._requested.append(-1)
            self._sent.append(0)
            self._expect.append(-1)
            self._heard.append(time.monotonic())
        self._pump = threading.Thread(target=self._receive, daemon=True, name="bcp-loader-pump")
        self._pump.start()
        _hook_exit()
        _OPEN.add(self)

    def _receive(self) -> None:
        """Route worker replies: windows to per-worker queues, states to their slots."""
        index = {id(c): i for i, c in enumerate(self._conns)}
        open_conns = list(self._conns)
        # this run's lists: close() empties the loader's, maybe before the last EOF is seen here
        heard, windows, prepared = self._heard, self._windows, self._prepared
        while open_conns:
            try:
                ready = wait(open_conns)
            except (OSError, ValueError):  # close() closed the pipes first
                return
            for conn in ready:
                w = index[id(conn)]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    open_conns.remove(conn)
                    msg = ("error", "the reader process exited")
                heard[w] = time.monotonic()
                if msg[0] == "error":
                    windows[w].put(("error", msg[1]))
                    with self._state_ready:
                        self._failed = f"data loader worker {w} failed: {msg[1]}"
                        self._state_ready.notify_all()
                elif msg[0] == "window":
                    windows[w].put(("window", msg[1]))
                else:
                    with self._state_ready:
                        prepared[w].clear()  # only the latest request's state is wanted
                        prepared[w][msg[1]] = (msg[2], msg[3])
                        self._state_ready.notify_all()

    def close(self) -> None:
        _OPEN.discard(self)
        if self._procs:
            self._closed_after = self.batches
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for w, proc in enumerate(self._procs):
            if w not in self._stalled:  # a stalled reader will not stop by itself
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._requested = [], [], []
        self._sent, self._expect, self._heard = [], [], []
        self._stalled = set()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- iteration --------------------------------------------------------------------
    def __iter__(self) -> TokenLoader:
        return self

    def _next_window(self) -> Any:
        rot = self._rotation
        workers = self.layout.workers
        for _ in range(workers):
            w = rot["next"]
            rot["next"] = (w + 1) % workers
            if rot["finished"][w]:
                continue
            self._conns[w].send(("next",))
            self._sent[w] += 1
            kind, window = self._await_window(w)
            if kind == "error":
                raise DataLoaderError(f"data loader worker {w} failed: {window}")
            if window is None:
                rot["finished"][w] = True
                continue
            return window
        return None

    def _await_window(self, w: int) -> tuple[str, Any]:
        """Worker ``w``'s reply to the "next" just sent; raises once it has said nothing for
        ``reader_timeout_s`` (counted from the request or its last reply, the later)."""
        asked = time.monotonic()
        while True:
            left = max(asked, self._heard[w]) + self.reader_timeout_s - time.monotonic()
            try:
                return self._windows[w].get(timeout=max(left, 0.0) + 0.01)
            except queue.Empty:
                if max(asked, self._heard[w]) + self.reader_timeout_s > time.monotonic():
                    continue  # it replied meanwhile (a state): wait on
            self._stalled.add(w)
            self._failed = (f"data loader worker {w} (pid {self._procs[w].pid}) sent nothing for "
                            f"{self.reader_timeout_s:g} s (TokenLoader reader_timeout_s)")
            raise DataLoaderError(
                f"{self._failed}: it is stalled (on storage, or stopped). The loader cannot go on: "
                "close() it, check the reader's storage, and resume from the last checkpoint")

    def __next__(self) -> TokenBatch:
        if self._failed is not None and self._stalled:
            raise DataLoaderError(f"{self._failed}; the loader stopped: close() it and resume "
                                  "from the last checkpoint")
        if not self._procs:
            self._check_not_closed("iterate it again", DataLoaderError)
            self._start()
        windows = []
        while len(windows) < self.batch_size:
            window = self._next_window()
            if window is None:
                break
            windows.append(window)
        if not windows:
            raise StopIteration
        self.batches += 1
        if self.checkpoint_every and (self.batches + 1) % self.checkpoint_every == 0:
            self._prepare_state(self.batches + 1)
        tokens = torch.from_numpy(np.stack([w.tokens for w in windows]).astype(np.int64))
        return TokenBatch(tokens, [w.valid for w in windows], [w.pieces for w in windows])

    def _prepare_state(self, tag: int) -> None:
        """Ask each worker for its state as it will be right after the next batch."""
        served = [0] * self.layout.workers
        nxt = self._rotation["next"]
        live = [w for w in range(self.layout.workers) if not self._rotation["finished"][w]]
        if not live:
            return
        for _ in range(self.batch_size):
            while self._rotation["finished"][nxt]:
                nxt = (nxt + 1) % self.layout.workers
            served[nxt] += 1
            nxt = (nxt + 1) % self.layout.workers
        for w, conn in enumerate(self._conns):
            conn.send(("state_after", served[w], tag))
            self._requested[w] = tag
            self._expect[w] = self._sent[w] + served[w]

    # -- state ------------------------------------------------------------------------
    def _check_not_closed(self, what: str, error: type[Exception]) -> None:
        """A closed loader knows only where it started, not where its readers were: refuse
        to go on from there (it would repeat the data already read)."""
        if self._closed_after is None:
            return
        raise error(
            f"this TokenLoader was closed after {self._closed_after} batches, which ended its "
            f"readers and their positions, so it cannot {what}: save the loader before close(), "
            "or make a new loader and load it from the last checkpoint")

    def _collect(self) -> list[StreamState]:
        if not self._procs:
            self._check_not_closed("save its state", StagingError)
            return list(self._states)
        t0 = time.perf_counter()
        tag = self.batches
        # A prefetched state is used only if the worker took it after exactly the "next"
        # requests the loader sent it (a worker that ran dry changes the rotation, so the
        # prediction can be off); otherwise the state is asked for now, which also drops
        # a prefetch request still pending in the worker.
        prepared = [self._requested[w] == tag and self._expect[w] == self._sent[w]
                    for w in range(len(self._conns))]
        self.last_collect_prepared = all(prepared)
        for w in range(len(self._conns)):
            if not prepared[w]:
                self._conns[w].send(("state", tag))
            self._requested[w] = -1  # a prefetched state serves one collection only

        def ready() -> bool:
            return all(p.get(tag, (None,))[0] == self._sent[w] for w, p in enumerate(self._prepared))

        with span("save.loader", prefetched=self.last_collect_prepared), self._state_ready:
            done = self._state_ready.wait_for(lambda: self._failed is not None or ready(),
                                              timeout=self.state_timeout_s)
            if self._failed is not None:
                raise StagingError(f"could not collect the data loader's state: {self._failed}")
            if not done:
                late = [w for w, p in enumerate(self._prepared)
                        if p.get(tag, (None,))[0] != self._sent[w]]
                raise StagingError(
                    f"data loader workers {late} did not report their state within "
                    f"{self.state_timeout_s:g} s (TokenLoader state_timeout_s), so this save "
                    "failed: check that the reader processes are alive and not stalled on "
                    "storage, then save again"
                )
            states = [StreamState.from_dict(p.pop(tag)[1]) for p in self._prepared]
            for p in self._prepared:
                p.clear()
        self.last_collect_s = time.perf_counter() - t0
        return states

    def _layout_key(self) -> str:
        """A marker entry naming the saved shard layout: a load with the same DP size, workers
        and window reads only its own shard; any other layout reads (and re-splits) all."""
        return f"layout/{self.dp_size}/{self.layout.workers}/{self.layout.window}/"

    def _fingerprints(self) -> list[dict[str, Any]]:
        if getattr(self, "_fps", None) is None:
            self._fps = [source_fingerprint(t) for t in self._opened]
        return self._fps

    def checkpoint_shards(self) -> dict[str, Any]:
        """The bytecheckpoint protocol: entries saved once each, by any rank holding them."""
        states = self._collect()
        shard = {"streams": [s.to_dict() for s in states], "rotation": self._rotation,
                 "batches": self.batches}
        replicated = self.layout.to_dict()
        replicated["fingerprints"] = self._fingerprints()
        return {REPLICATED: replicated, f"shard/{self.dp_size}/{self.dp_rank}": shard,
                self._layout_key() + "same": {"dp_size": self.dp_size}}

    def load_prefixes(self, has_saved: Callable[[str], bool]) -> list[str]:
        """Which saved entries a load must read: this rank's shard when the DP size, the
        workers and the window are the same, every shard (to merge and re-split) otherwise."""
        own = f"shard/{self.dp_size}/{self.dp_rank}"
        if has_saved(own) and has_saved(self._layout_key()):
            return [REPLICATED, own, "layout/"]
        return [REPLICATED, "shard/", "layout/"]

    def _check_sources(self, saved: Layout, fingerprints: Any) -> None:
        """The saved positions mean something only for the sources they were taken on."""
        if len(saved.sources) != len(self.layout.sources):
            raise StateMismatchError(
                f"the checkpoint's loader read {len(saved.sources)} sources, this one has "
                f"{len(self.layout.sources)}; resume with the same sources"
            )
        if fingerprints is not None and (not isinstance(fingerprints, list)
                                         or len(fingerprints) != len(saved.sources)):
            raise CorruptCheckpointError("the data loader's saved source fingerprints are malformed")
        for i, (was, now) in enumerate(zip(saved.sources, self.layout.sources)):
            hint = ("resume with the same sources in the same order (a source may only have "
                    "grown by appending samples)")
            if fingerprints is None:  # a checkpoint from before fingerprints: paths only
                if os.path.normpath(str(was)) != os.path.normpath(str(now)):
                    raise StateMismatchError(
                        f"data loader source {i} is {now}, the checkpoint read {was} there; {hint}")
                continue
            fp = fingerprints[i]
            try:
                samples = int(fp["samples"])
            except (KeyError, TypeError, ValueError):
                raise CorruptCheckpointError(
                    f"the data loader's saved fingerprint of source {i} is malformed") from None
            if samples > self._sizes[i]:
                raise StateMismatchError(
                    f"data loader source {i} ({now}) has {self._sizes[i]} samples, the checkpoint's "
                    f"({was}) had {samples}; {hint}")
            if source_fingerprint(self._opened[i], samples) != fp:
                raise StateMismatchError(
                    f"data loader source {i} ({now}) is not the source the checkpoint read there "
                    f"({was}): its samples differ; {hint}")

    def _check_not_started(self) -> None:
        """A load replaces the loader's position; readers already started hold their own
        (a loader only restored, even several times, has none and takes the new one)."""
        if self._procs or self._closed_after:
            raise StateMismatchError(
                f"this TokenLoader was already iterated ({self.batches} batches; its readers "
                "started), so a checkpoint's position cannot replace its own: load the checkpoint "
                "into a new TokenLoader made with the same arguments")

    def restore_shards(self, entries: dict[str, Any]) -> None:
        if REPLICATED not in entries:
            raise StateMismatchError("the checkpoint holds no state for this data loader")
        self._check_not_started()
        try:
            saved = Layout.from_dict(entries[REPLICATED])
            fingerprints = entries[REPLICATED].get("fingerprints")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptCheckpointError(f"the data loader's saved layout is malformed: {exc!r}") from None
        self._check_sources(saved, fingerprints)
        sizes = self._sizes
        validate_layout(saved, sizes)
        own = f"shard/{self.dp_size}/{self.dp_rank}"
        same_layout = (saved.dp_size == self.dp_size and saved.workers == self.layout.workers
                       and saved.window == self.layout.window and own in entries)
        saved.sources, saved.ratios = list(self.layout.sources), list(self.layout.ratios)
        if same_layout:
            states, rotation, batches = validate_shard(entries[own], self.dp_rank, saved, self._opened)
            self.layout = saved
            self._states = states
            # Each reader is asked again: one that had run dry answers "no more" at once (the
            # same batches), unless its source grew by appending samples, which it then reads.
            self._rotation = {"next": rotation["next"], "finished": [False] * saved.workers}
            self.batches = batches
            self._closed_after = None  # a position again, replacing the one close() lost
            return
        shards = {k.rsplit("/", 1)[1]: v for k, v in entries.items()
                  if k.startswith(f"shard/{saved.dp_size}/")}
        ranks = sorted(int(r) for r in shards if r.isdigit())
        if len(ranks) != saved.dp_size or ranks != list(range(saved.dp_size)):  # dp_size may be huge
            raise StateMismatchError(
                f"resharding the data loader needs all {saved.dp_size} saved DP shards; the "
                f"checkpoint has {ranks}"
            )
        states = [s for r in ranks for s in validate_shard(shards[str(r)], r, saved, self._opened)[0]]
        saved.window = self.layout.window
        layout, new_states = reshard(saved, states, sizes, self.dp_size, self.layout.workers)
        self.layout = layout
        self._states = self._own(new_states)
        self._rotation = {"next": 0, "finished": [False] * self.layout.workers}
        self.batches = 0
        self._closed_after = None
