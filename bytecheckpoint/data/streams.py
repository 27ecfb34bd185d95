"""Reader streams: which samples a reader worker reads, its token buffer, and resharding.

The data-parallel ranks' reader workers form ``G = dp_size * workers`` streams. Stream ``g``
reads sample ``frontier + g + k*G`` of each source (k = 0, 1, ...), skipping indices in the
source's skip set, choosing the next source with its own RNG weighted by the sampling
ratios. What it reads goes into a token buffer; fixed windows of ``window`` tokens are cut
from its front, so a stream's windows depend only on its state, never on timing.

Resharding to another number of streams keeps every sample exactly once: everything below a
source's new frontier has been read, the indices above it that were read are the new skip
set, and the buffered (read, not yet emitted) pieces are dealt out to the new streams.
This module is numpy only: reader processes import it without torch.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .source import TokenSource

ID_BITS = 40  # sample id = source << 40 | index


def sample_id(source: int, index: int) -> int:
    return (source << ID_BITS) | index


@dataclass
class Layout:
    """The replicated part of a loader's state: the same on every rank."""

    sources: list[str]
    ratios: list[float]
    seed: int
    window: int  # tokens per emitted window (context + 1)
    workers: int  # reader workers per data-parallel rank
    dp_size: int
    buffer_tokens: int  # a stream reads ahead until its buffer holds this many tokens
    pad_id: int = 0
    generation: int = 0  # bumped by every reshard; seeds new streams' RNGs
    frontiers: list[int] = field(default_factory=list)
    skips: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.frontiers:
            self.frontiers = [0] * len(self.sources)
        if not self.skips:
            self.skips = [np.zeros(0, dtype=np.int64) for _ in self.sources]

    @property
    def streams(self) -> int:
        return self.dp_size * self.workers

    def to_dict(self) -> dict[str, Any]:
        return {"sources": list(self.sources), "ratios": [float(r) for r in self.ratios],
                "seed": self.seed, "window": self.window, "workers": self.workers,
                "dp_size": self.dp_size, "buffer_tokens": self.buffer_tokens, "pad_id": self.pad_id,
                "generation": self.generation, "frontiers": list(self.frontiers),
                "skips": [np.asarray(s, dtype=np.int64) for s in self.skips]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        return cls(list(d["sources"]), list(d["ratios"]), int(d["seed"]), int(d["window"]),
                   int(d["workers"]), int(d["dp_size"]), int(d["buffer_tokens"]), int(d["pad_id"]),
                   int(d["generation"]), [int(f) for f in d["frontiers"]],
                   [np.asarray(s, dtype=np.int64) for s in d["skips"]])


@dataclass
class Pieces:
    """Token runs in order: run i is tokens [start, start + length) of sample ``ids[i]``."""

    ids: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray

    @classmethod
    def empty(cls) -> Pieces:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z.copy(), z.copy())


@dataclass
class Window:
    tokens: np.ndarray  # int32, exactly ``window`` long (padded at the very end of the data)
    pieces: Pieces
    valid: int  # real tokens (the rest is padding)


@dataclass
class StreamState:
    """The sharded part: one reader stream (one worker of one data-parallel rank)."""

    stream: int
    cursors: list[int]  # per source: stride steps taken
    rng: dict[str, Any]
    tokens: np.ndarray  # buffered tokens, int32
    pieces: Pieces
    windows: int = 0  # windows emitted so far

    def to_dict(self) -> dict[str, Any]:
        return {"stream": self.stream, "cursors": list(self.cursors), "rng": self.rng,
                "tokens": self.tokens, "ids": self.pieces.ids, "starts": self.pieces.starts,
                "lengths": self.pieces.lengths, "windows": self.windows}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamState:
        return cls(int(d["stream"]), [int(c) for c in d["cursors"]], d["rng"],
                   np.asarray(d["tokens"], dtype=np.int32),
                   Pieces(np.asarray(d["ids"], dtype=np.int64), np.asarray(d["starts"], dtype=np.int64),
                          np.asarray(d["lengths"], dtype=np.int64)), int(d["windows"]))

    @property
    def buffered(self) -> int:
        return int(self.tokens.size)


def fresh_rng(seed: int, generation: int, stream: int) -> dict[str, Any]:
    return np.random.default_rng([seed, generation, stream]).bit_generator.state


def initial_states(layout: Layout) -> list[StreamState]:
    return [StreamState(g, [0] * len(layout.sources), fresh_rng(layout.seed, layout.generation, g),
                        np.zeros(0, dtype=np.int32), Pieces.empty())
            for g in range(layout.streams)]


class Stream:
    """A live reader stream: reads samples, buffers tokens, cuts windows."""

    def __init__(self, layout: Layout, state: StreamState, sources: Sequence[TokenSource],
                 ahead: int = 63) -> None:
        """``ahead``: the most windows cut and not yet handed out that a snapshot must rewind
        (the worker's ``prefetch``)."""
        self.layout = layout
        self.sources = sources
        self.stream = state.stream
        self.cursors = list(state.cursors)
        self.rng = np.random.default_rng()
        self.rng.bit_generator.state = state.rng
        self.windows = state.windows
        # the buffer as a deque of (sample id, start, tokens); popping the front is O(1)
        self.buffer: collections.deque[tuple[int, int, np.ndarray]] = collections.deque()
        self.buffered = 0
        pos = 0
        for sid, start, n in zip(state.pieces.ids, state.pieces.starts, state.pieces.lengths):
            self.buffer.append((int(sid), int(start), state.tokens[pos : pos + int(n)]))
            pos += int(n)
            self.buffered += int(n)
        self.live = [self._candidate(s) is not None for s in range(len(sources))]
        # (cursors, rng, live, buffered tokens) right after each recent cut, so a snapshot
        # can describe the stream as of any window not yet handed out: the same state
        # however far the worker has read ahead.
        self.marks: collections.deque[tuple[list[int], dict[str, Any], list[bool], int]] = (
            collections.deque(maxlen=max(64, ahead + 1)))
        self._mark()

    def _mark(self) -> None:
        self.marks.append((list(self.cursors), self.rng.bit_generator.state, list(self.live),
                           self.buffered))

    def _candidate(self, s: int) -> int | None:
        """Next unread index of source ``s`` for this stream (advancing past skipped ones)."""
        layout, skips = self.layout, self.layout.skips[s]
        while True:
            i = layout.frontiers[s] + self.stream + self.cursors[s] * layout.streams
            if i >= len(self.sources[s]):
                return None
            if skips.size and skips[min(np.searchsorted(skips, i), skips.size - 1)] == i:
                self.cursors[s] += 1
                continue
            return i

    def _read_one(self) -> bool:
        live = [s for s, ok in enumerate(self.live) if ok]
        if not live:
            return False
        weights = np.array([self.layout.ratios[s] for s in live], dtype=np.float64)
        s = live[int(self.rng.choice(len(live), p=weights / weights.sum()))]
        i = self._candidate(s)
        assert i is not None
        self.cursors[s] += 1
        tokens = self.sources[s].sample(i)
        if tokens.size:
            self.buffer.append((sample_id(s, i), 0, tokens))
            self.buffered += int(tokens.size)
        self.live[s] = self._candidate(s) is not None
        return True

    def fill(self) -> None:
        while self.buffered < max(self.layout.buffer_tokens, self.layout.window) and self._read_one():
            pass

    def next_window(self) -> Window | None:
        """The next window, a final padded one at the end of the data, then None."""
        self.fill()
        if self.buffered == 0:
            return None
        n = min(self.layout.window, self.buffered)
        out = np.full(self.layout.window, self.layout.pad_id, dtype=np.int32)
        ids, starts, lengths = [], [], []
        filled = 0
        while filled < n:
            sid, start, toks = self.buffer[0]
            take = min(n - filled, toks.size)
            out[filled : filled + take] = toks[:take]
            ids.append(sid)
            starts.append(start)
            lengths.append(take)
            filled += take
            if take == toks.size:
                self.buffer.popleft()
            else:
                self.buffer[0] = (sid, start + take, toks[take:])
        self.buffered -= n
        self.windows += 1
        self._mark()
        pieces = Pieces(np.array(ids, dtype=np.int64), np.array(starts, dtype=np.int64),
                        np.array(lengths, dtype=np.int64))
        return Window(out, pieces, n)

    def snapshot(self, pending: Sequence[Window] = ()) -> StreamState:
        """The stream's state as it was before the ``pending`` windows (cut, not yet handed
        out) were cut: they go back in front of the buffer, and what was read after is
        dropped again (cursors and RNG rewound), so the state does not depend on how far
        the worker had read ahead. Runs of one sample are merged, for the same reason."""
        if len(pending) >= len(self.marks):
            raise RuntimeError("a reader worker cut more windows ahead than it can rewind")
        cursors, rng, _, kept = self.marks[-1 - len(pending)]
        runs: list[tuple[int, int, np.ndarray]] = []
        for w in pending:
            pos = 0
            for sid, start, n in zip(w.pieces.ids, w.pieces.starts, w.pieces.lengths):
                runs.append((int(sid), int(start), w.tokens[pos : pos + int(n)]))
                pos += int(n)
        runs.extend(self.buffer)
        # The buffer as it was at the mark is the first ``kept`` tokens of the pending
        # windows followed by the buffer now; samples read later start runs of their own,
        # so the cut falls between runs.
        limit = kept
        merged: list[list[Any]] = []
        total = 0
        for sid, start, toks in runs:
            if total >= limit:
                break
            total += int(toks.size)
            last = merged[-1] if merged else None
            if last is not None and last[0] == sid and last[1] + last[2] == start:
                last[2] += int(toks.size)
                last[3].append(toks)
            else:
                merged.append([sid, start, int(toks.size), [toks]])
        assert total == limit, "a reader stream's buffer does not match its mark"
        chunks = [t for m in merged for t in m[3]]
        tokens = np.concatenate(chunks).astype(np.int32, copy=False) if chunks else np.zeros(0, np.int32)
        return StreamState(self.stream, list(cursors), rng, tokens,
                           Pieces(np.array([m[0] for m in merged], dtype=np.int64),
                                  np.array([m[1] for m in merged], dtype=np.int64),
                                  np.array([m[2] for m in merged], dtype=np.int64)),
                           self.windows - len(pending))


def reshard(layout: Layout, states: Sequence[StreamState], sizes: Sequence[int], dp_size: int,
            workers: int) -> tuple[Layout, list[StreamState]]:
    """Merge every stream's state and split it over ``dp_size * workers`` new streams.

    ``states`` are all ``layout.streams`` old streams; ``sizes`` the sources' sample counts.
    """
    if sorted(s.stream for s in states) != list(range(layout.streams)):
        raise ValueError(f"resharding needs all {layout.streams} streams of the saved loader")
    states = sorted(states, key=lambda s: s.stream)
    frontiers, skips = [], []
    for src, size in enumerate(sizes):
        base, stride = layout.frontiers[src], layout.streams
        nxt = [base + st.stream + st.cursors[src] * stride for st in states]
        frontier = min(min(nxt), size)
        read = [np.arange(base + st.stream, min(n, size), stride, dtype=np.int64)
                for st, n in zip(states, nxt)]
        above = np.concatenate([r[r >= frontier] for r in read] + [layout.skips[src]])
        skips.append(np.unique(above[above >= frontier]))
        frontiers.append(int(frontier))
    new = Layout(layout.sources, layout.ratios, layout.seed, layout.window, workers, dp_size,
                 layout.buffer_tokens, layout.pad_id, layout.generation + 1, frontiers, skips)
    # Deal the buffered pieces, in order, to the new stream holding the fewest tokens.
    count = new.streams
    parts: list[list[tuple[int, int, np.ndarray]]] = [[] for _ in range(count)]
    load = [0] * count
    for st in states:
        pos = 0
        for sid, start, n in zip(st.pieces.ids, st.pieces.starts, st.pieces.lengths):
            target = min(range(count), key=lambda g: (load[g], g))
            parts[target].append((int(sid), int(start), st.tokens[pos : pos + int(n)]))
            load[target] += int(n)
            pos += int(n)
    out = []
    for g in range(count):
        p = parts[g]
        tokens = np.concatenate([t for _, _, t in p]).astype(np.int32) if p else np.zeros(0, np.int32)
        out.append(StreamState(g, [0] * len(sizes), fresh_rng(new.seed, new.generation, g), tokens,
                               Pieces(np.array([a for a, _, _ in p], dtype=np.int64),
                                      np.array([b for _, b, _ in p], dtype=np.int64),
                                      np.array([t.size for _, _, t in p], dtype=np.int64))))
    return new, out


# -- checks of a saved state ---------------------------------------------------------------
def source_fingerprint(source: TokenSource, samples: int | None = None) -> dict[str, Any]:
    """A cheap identity of a source's first ``samples`` samples (default: all): their count
    and a hash of their offsets and of the first and last tokens. Appending samples keeps
    the fingerprint of the old ones."""
    import hashlib

    n = len(source) if samples is None else samples
    end = int(source.offsets[n])
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(source.offsets[: n + 1], dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(source.tokens[: min(end, 1024)], dtype="<i4").tobytes())
    h.update(np.ascontiguousarray(source.tokens[max(0, end - 1024) : end], dtype="<i4").tobytes())
    return {"samples": int(n), "blake2b": h.hexdigest()}


def _corrupt(field_name: str, why: str) -> Exception:
    from ..errors import CorruptCheckpointError

    return CorruptCheckpointError(f"the data loader's saved state is damaged: {field_name} {why}")


def validate_layout(layout: Layout, sizes: Sequence[int]) -> None:
    """Range checks of the replicated part against the sources (``sizes``: samples each)."""
    for name in ("window", "workers", "dp_size"):
        if getattr(layout, name) < 1:
            raise _corrupt(f"replicated.{name}", f"is {getattr(layout, name)}, not >= 1")
    if layout.buffer_tokens < 0 or layout.generation < 0 or layout.seed < 0:
        raise _corrupt("replicated.buffer_tokens/generation/seed", "is negative")
    if not -(1 << 31) <= layout.pad_id < 1 << 31:  # windows are int32
        raise _corrupt("replicated.pad_id", f"is {layout.pad_id}, not an int32 token id")
    if len(layout.frontiers) != len(sizes) or len(layout.skips) != len(sizes):
        raise _corrupt("replicated.frontiers/skips", f"do not hold one entry per source ({len(sizes)})")
    for s, (frontier, skips, size) in enumerate(zip(layout.frontiers, layout.skips, sizes)):
        if not 0 <= frontier <= size:
            raise _corrupt(f"replicated.frontiers[{s}]", f"is {frontier}, outside 0..{size}")
        if skips.ndim != 1 or (skips.size and (skips[0] < frontier or skips[-1] >= size
                                               or np.any(np.diff(skips) <= 0))):
            raise _corrupt(f"replicated.skips[{s}]",
                           f"is not an increasing list of sample indices in {frontier}..{size - 1}")


def validate_shard(shard: Any, rank: int, layout: Layout, sources: Sequence[TokenSource],
                   ) -> tuple[list[StreamState], dict[str, Any], int]:
    """Decode and range-check one DP rank's saved shard: its streams, rotation and batches."""
    try:
        streams = [StreamState.from_dict(s) for s in shard["streams"]]
        rotation = {"next": int(shard["rotation"]["next"]),
                    "finished": [bool(f) for f in shard["rotation"]["finished"]]}
        batches = int(shard["batches"])
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise _corrupt(f"shard {rank}", f"is malformed ({exc!r})") from None
    w = layout.workers
    ids = [s.stream for s in streams]
    if len(ids) != w or ids != list(range(rank * w, (rank + 1) * w)):  # w may be huge
        raise _corrupt(f"shard {rank} stream ids", f"are {ids}, not {rank * w}..{(rank + 1) * w - 1}")
    if not 0 <= rotation["next"] < w:
        raise _corrupt(f"shard {rank} rotation.next", f"is {rotation['next']}, outside 0..{w - 1}")
    if len(rotation["finished"]) != w:
        raise _corrupt(f"shard {rank} rotation.finished", f"holds {len(rotation['finished'])} flags, not {w}")
    if batches < 0:
        raise _corrupt(f"shard {rank} batches", f"is {batches}")
    G, nsrc = layout.streams, len(sources)
    for st in streams:
        where = f"shard {rank} stream {st.stream}"
        if len(st.cursors) != nsrc:
            raise _corrupt(f"{where} cursors", f"hold {len(st.cursors)} entries, not one per source ({nsrc})")
        for s, c in enumerate(st.cursors):
            most = max(0, -(-(len(sources[s]) - layout.frontiers[s] - st.stream) // G))
            if not 0 <= c <= most:
                raise _corrupt(f"{where} cursors[{s}]", f"is {c}, outside 0..{most}")
        if st.windows < 0:
            raise _corrupt(f"{where} windows", f"is {st.windows}")
        try:
            np.random.default_rng().bit_generator.state = st.rng
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise _corrupt(f"{where} rng", f"is not a generator state ({exc!r})") from None
        p = st.pieces
        if (st.tokens.ndim != 1 or p.ids.ndim != 1 or not p.ids.size == p.starts.size == p.lengths.size):
            raise _corrupt(f"{where} ids/starts/lengths", "are not lists of one length")
        if p.lengths.size and int(p.lengths.min()) < 1:
            raise _corrupt(f"{where} lengths", "hold a length < 1")
        if int(p.lengths.sum()) != st.tokens.size:
            raise _corrupt(f"{where} lengths",
                           f"sum to {int(p.lengths.sum())}, the buffer holds {st.tokens.size} tokens")
        if p.starts.size and int(p.starts.min()) < 0:
            raise _corrupt(f"{where} starts", "hold a negative start")
        src, idx = p.ids >> ID_BITS, p.ids & ((1 << ID_BITS) - 1)
        if p.ids.size and (int(p.ids.min()) < 0 or int(src.max()) >= nsrc):
            raise _corrupt(f"{where} ids", f"name a source outside 0..{nsrc - 1}")
        for s in np.unique(src):
            sel = src == s
            off = sources[int(s)].offsets
            i = idx[sel]
            if int(i.max()) >= len(sources[int(s)]):
                raise _corrupt(f"{where} ids",
                               f"name a sample beyond source {int(s)}'s {len(sources[int(s)])}")
            if np.any(p.starts[sel] + p.lengths[sel] > off[i + 1] - off[i]):
                raise _corrupt(f"{where} starts/lengths", f"run past the end of a sample of source {int(s)}")
    return streams, rotation, batches
