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

import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import numpy as np
import torch

from telemetry import span

from ..errors import StateMismatchError
from .source import TokenSource
from .streams import Layout, Pieces, StreamState, initial_states, reshard
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
    """

    def __init__(self, sources: Sequence[str], ratios: Sequence[float] | None = None, *, context: int,
                 batch_size: int, workers: int = 2, dp_rank: int | None = None,
                 dp_size: int | None = None, seed: int = 0, buffer_tokens: int = 4096,
                 prefetch: int = 4, checkpoint_every: int | None = None, pad_id: int = 0,
                 start_method: str = "fork") -> None:
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
        self._sizes = [len(TokenSource(p)) for p in sources]  # also validates the sources
        self.layout = Layout(list(sources), ratios, seed, context + 1, workers, dp_size, buffer_tokens,
                             pad_id)
        self._states = self._own(initial_states(self.layout))
        self._rotation = {"next": 0, "finished": [False] * workers}
        self.batches = 0
        self.last_collect_s = 0.0
        self.last_collect_prepared = False  # whether the last collection was prefetched
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._requested: list[int] = []  # per worker: the tag of its last state request
        self._failed: str | None = None

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
            proc = ctx.Process(target=run_worker, daemon=True,
                               args=(child, self.layout.to_dict(), state.to_dict(), self.prefetch))
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
            self._windows.append(queue.Queue())
            self._prepared.append({})
            self._requested.append(-1)
        self._pump = threading.Thread(target=self._receive, daemon=True, name="bcp-loader-pump")
        self._pump.start()

    def _receive(self) -> None:
        """Route worker replies: windows to per-worker queues, states to their slots."""
        index = {id(c): i for i, c in enumerate(self._conns)}
        open_conns = list(self._conns)
        while open_conns:
            for conn in wait(open_conns):
                w = index[id(conn)]
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    open_conns.remove(conn)
                    msg = ("error", "the reader process exited")
                if msg[0] == "error":
                    self._windows[w].put(("error", msg[1]))
                    with self._state_ready:
                        self._failed = f"data loader worker {w} failed: {msg[1]}"
                        self._state_ready.notify_all()
                elif msg[0] == "window":
                    self._windows[w].put(("window", msg[1]))
                else:
                    with self._state_ready:
                        self._prepared[w][msg[1]] = msg[2]
                        self._state_ready.notify_all()

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._requested = [], [], []

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
            kind, window = self._windows[w].get()
            if kind == "error":
                raise RuntimeError(f"data loader worker {w} failed: {window}")
            if window is None:
                rot["finished"][w] = True
                continue
            return window
        return None

    def __next__(self) -> TokenBatch:
        if not self._procs:
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

    # -- state ------------------------------------------------------------------------
    def _collect(self) -> list[StreamState]:
        if not self._procs:
            return list(self._states)
        t0 = time.perf_counter()
        tag = self.batches
        self.last_collect_prepared = all(r == tag for r in self._requested)
        for w in range(len(self._conns)):
            if self._requested[w] != tag:  # not prepared ahead (or for another batch)
                self._conns[w].send(("state", tag))
                self._requested[w] = tag
        with span("save.loader", prefetched=self.last_collect_prepared), self._state_ready:
            self._state_ready.wait_for(
                lambda: self._failed is not None or all(tag in p for p in self._prepared))
            if self._failed is not None:
                raise RuntimeError(self._failed)
            states = [StreamState.from_dict(p.pop(tag)) for p in self._prepared]
            for p in self._prepared:
                p.clear()
        self.last_collect_s = time.perf_counter() - t0
        return states

    def checkpoint_shards(self) -> dict[str, Any]:
        """The bytecheckpoint protocol: entries saved once each, by any rank holding them."""
        states = self._collect()
        shard = {"streams": [s.to_dict() for s in states], "rotation": self._rotation,
                 "batches": self.batches}
        return {REPLICATED: self.layout.to_dict(), f"shard/{self.dp_size}/{self.dp_rank}": shard}

    def load_prefixes(self, has_saved: Callable[[str], bool]) -> list[str]:
        """Which saved entries a load must read: this rank's shard when the DP size is the
        same, every shard (to merge and re-split) when it is not."""
        own = f"shard/{self.dp_size}/{self.dp_rank}"
        return [REPLICATED, own] if has_saved(own) else [REPLICATED, "shard/"]

    def restore_shards(self, entries: dict[str, Any]) -> None:
        if REPLICATED not in entries:
            raise StateMismatchError("the checkpoint holds no state for this data loader")
        saved = Layout.from_dict(entries[REPLICATED])
        if len(saved.sources) != len(self.layout.sources):
            raise StateMismatchError(
                f"the checkpoint's loader read {len(saved.sources)} sources, this one has "
                f"{len(self.layout.sources)}; resume with the same sources"
            )
        if self.batches or self._procs:
            raise StateMismatchError("load the data loader's state before iterating it")
        sizes = self._sizes
        own = f"shard/{self.dp_size}/{self.dp_rank}"
        same_layout = (saved.dp_size == self.dp_size and saved.workers == self.layout.workers
                       and saved.window == self.layout.window and own in entries)
        saved.sources, saved.ratios = list(self.layout.sources), list(self.layout.ratios)
        if same_layout:
            shard = entries[own]
            self.layout = saved
            self._states = [StreamState.from_dict(s) for s in shard["streams"]]
            self._rotation = {"next": int(shard["rotation"]["next"]),
                              "finished": [bool(f) for f in shard["rotation"]["finished"]]}
            self.batches = int(shard["batches"])
            return
        shards = {int(k.rsplit("/", 1)[1]): v for k, v in entries.items()
                  if k.startswith(f"shard/{saved.dp_size}/")}
        if sorted(shards) != list(range(saved.dp_size)):
            raise StateMismatchError(
                f"resharding the data loader needs all {saved.dp_size} saved DP shards; the "
                f"checkpoint has {sorted(shards)}"
            )
        states = [StreamState.from_dict(s) for r in sorted(shards) for s in shards[r]["streams"]]
        saved.window = self.layout.window
        layout, new_states = reshard(saved, states, sizes, self.dp_size, self.layout.workers)
        self.layout = layout
        self._states = self._own(new_states)
        self._rotation = {"next": 0, "finished": [False] * self.layout.workers}
        self.batches = 0
