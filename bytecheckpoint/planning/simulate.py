"""A save at thousands of ranks, without the processes: synthetic local plans run through the
real coordinator code.

``local_plans`` builds every rank's ``LocalSavePlan`` for a Llama-style model under tensor,
pipeline and data parallelism with a ZeRO-1 distributed optimizer: bf16 weights split by TP
(column / row parallel, vocab-parallel embedding and head), replicated over DP; fp32 master
weights, ``exp_avg`` and ``exp_avg_sq`` flattened per (PP stage, TP rank) and cut into DP
slices, which become irregular flat ranges (``flat_range_boxes``), as Megatron's distributed
optimizer makes them. ``simulate`` then runs what the coordinator runs on a real save:
``plan_save`` (dedup, balance, coverage), the metadata template and build, encode, decode,
and a cached re-plan (the shared-object check and the metadata from the template), timing
each stage. Ranks' writes are synthesised from the plan (byte offsets in plan order, one
checksum per 4 MiB chunk), so the metadata has the size a real save's would.

It also counts the storage files and file-system metadata operations a save makes, per rank
(one file per rank and kind, the engine's default) and per host (one file per host and kind,
what ``save(..., files_per="host")`` makes, same names), because thousands of small files load a file system's
metadata server (HDFS NameNode) more than their bytes load its data nodes.
"""

from __future__ import annotations

import gc
import math
import resource
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..format.boxes import Box, flat_range_boxes
from ..format.checksums import DEFAULT_CHUNK_BYTES
from ..format.metadata import ByteMeta, CheckpointMetadata, FileMeta, ObjectMeta
from .global_plan import GlobalSavePlan, LocalSavePlan, WriteItem, check_shared_objects, plan_save


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder: ``layers`` blocks of GQA attention and a SwiGLU MLP."""

    layers: int = 126
    hidden: int = 16384
    ffn: int = 53248
    vocab: int = 128256
    kv_heads: int = 8
    head_dim: int = 128

    def tensors(self) -> list[tuple[str, tuple[int, ...], int | None, int]]:
        """``(fqn, shape, tp_dim, stage_layer)`` in parameter order; ``tp_dim`` is the dimension
        TP splits (None: replicated over TP); ``stage_layer`` -1 is the embedding (first
        stage), ``layers`` the final norm and head (last stage)."""
        h, f, kv = self.hidden, self.ffn, self.kv_heads * self.head_dim
        out: list[tuple[str, tuple[int, ...], int | None, int]] = [
            ("embed_tokens.weight", (self.vocab, h), 0, -1)]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [
                (p + "attention_norm.weight", (h,), None, i),
                (p + "attention.wq.weight", (h, h), 0, i),
                (p + "attention.wk.weight", (kv, h), 0, i),
                (p + "attention.wv.weight", (kv, h), 0, i),
                (p + "attention.wo.weight", (h, h), 1, i),
                (p + "ffn_norm.weight", (h,), None, i),
                (p + "feed_forward.w1.weight", (f, h), 0, i),
                (p + "feed_forward.w3.weight", (f, h), 0, i),
                (p + "feed_forward.w2.weight", (h, f), 1, i),
            ]
        out += [("norm.weight", (h,), None, self.layers), ("output.weight", (self.vocab, h), 0, self.layers)]
        return out

    @property
    def parameters(self) -> int:
        return sum(math.prod(s) for _, s, _, _ in self.tensors())


LLAMA_405B = ModelSpec()


@dataclass(frozen=True)
class Layout:
    """Megatron's rank order: TP fastest, then DP, then PP. A host holds ``ranks_per_host``
    consecutive ranks (a TP group when it is 8)."""

    tp: int
    pp: int
    dp: int
    ranks_per_host: int = 8

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def for_world(cls, world: int, tp: int = 8, pp: int = 16, ranks_per_host: int = 8) -> Layout:
        if world % (tp * pp):
            raise ValueError(f"world {world} is not a multiple of TP*PP = {tp * pp}")
        return cls(tp, pp, world // (tp * pp), ranks_per_host)

    def rank(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp


OPTIM_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


def _stage_layers(spec: ModelSpec, pp: int) -> list[range]:
    bounds = np.linspace(0, spec.layers, pp + 1).round().astype(int)
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def local_plans(spec: ModelSpec, layout: Layout, *, object_bytes: int = 4096) -> list[LocalSavePlan]:
    """Every rank's local save plan. Ranks of one (stage, TP rank) share their weight items
    (the same objects: generation stays fast; planning treats them as separate offers)."""
    tensors = spec.tensors()
    stages = _stage_layers(spec, layout.pp)
    plans: list[LocalSavePlan | None] = [None] * layout.world
    for s, layer_range in enumerate(stages):
        lo, hi = layer_range.start, layer_range.stop
        mine = [t for t in tensors if lo <= t[3] < hi or (t[3] == -1 and s == 0)
                or (t[3] == spec.layers and s == layout.pp - 1)]
        # Hyperparameters per parameter, identical on every holder (a shared object each).
        shared = {f"optimizer/param_groups/{fqn}": (96, zlib.crc32(fqn.encode())) for fqn, *_ in mine}
        shared["optimizer/param_groups"] = (256, 7)
        for t in range(layout.tp):
            local: list[tuple[str, tuple[int, ...], Box]] = []
            for fqn, shape, tp_dim, _ in mine:
                if tp_dim is None:
                    box = Box((0,) * len(shape), shape)
                else:
                    n = shape[tp_dim] // layout.tp
                    offsets = tuple(t * n if d == tp_dim else 0 for d in range(len(shape)))
                    lengths = tuple(n if d == tp_dim else x for d, x in enumerate(shape))
                    box = Box(offsets, lengths)
                local.append((fqn, shape, box))
            weights = [WriteItem(f"model/{fqn}", "bfloat16", shape, box) for fqn, shape, box in local]
            starts = np.cumsum([0] + [b.numel for _, _, b in local])
            total = int(starts[-1])
            cuts = [total * d // layout.dp for d in range(layout.dp + 1)]
            for d in range(layout.dp):
                a, b = cuts[d], cuts[d + 1]
                items = list(weights)
                first = int(np.searchsorted(starts, a, side="right")) - 1
                for j in range(max(first, 0), len(local)):
                    t0, t1 = int(starts[j]), int(starts[j + 1])
                    if t0 >= b:
                        break
                    fqn, shape, box = local[j]
                    pieces = flat_range_boxes(box.lengths, max(a, t0) - t0, min(b, t1) - t0)
                    for piece in pieces:
                        g = Box(tuple(o + p for o, p in zip(box.offsets, piece.offsets)), piece.lengths)
                        items += [WriteItem(f"optimizer/state/{fqn}/{name}", "float32", shape, g)
                                  for name in OPTIM_STATES]
                rank = layout.rank(s, d, t)
                # A dict per rank, as unpickled on the coordinator (equal, never identical).
                plans[rank] = LocalSavePlan(rank, items, object_bytes, dict(shared))
    assert all(p is not None for p in plans)
    return plans  # type: ignore[return-value]


# -- what the ranks would write --------------------------------------------------------------


def _kind(key: str) -> str:
    return "model" if key.startswith("model/") else "optim"


def host_of(rank: int, layout: Layout) -> int:
    return rank // layout.ranks_per_host


def synthetic_writes(plan: GlobalSavePlan, layout: Layout, *, files_per: str = "rank",
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Any]:
    """What each rank's write would report: byte offsets in plan order and one placeholder
    checksum per chunk, in the engine's ``RankWrite`` form. ``files_per="host"``: the ranks of
    a host append to one file per kind (rank order), so offsets continue across ranks."""
    from .save_metadata import RankWrite, box_columns

    header = 4096  # a safetensors header, roughly
    cursor: dict[tuple[int, str], int] = {}
    writes = []
    for rank, items in enumerate(plan.assignments):
        owner = host_of(rank, layout) if files_per == "host" else rank
        tag = f"h{owner:05d}" if files_per == "host" else f"{owner:05d}"
        boxes = []
        for item in items:
            kind = _kind(item.key)
            fname = f"{kind}-{tag}.safetensors"
            off = cursor.setdefault((owner, kind), header)
            n = item.nbytes
            sums = tuple(range(-(-n // chunk_bytes)))
            boxes.append((item.key, item.box, ByteMeta(fname, off, n, sums)))
            cursor[(owner, kind)] = off + n
        fname = f"extra-{tag}.safetensors"
        off = cursor.setdefault((owner, "extra"), header)
        objects = [ObjectMeta(f"rank_state.{rank}", rank, ByteMeta(fname, off, 4096, (0,)))]
        cursor[(owner, "extra")] = off + 4096
        off += 4096
        for key in plan.shared_assignments[rank]:
            objects.append(ObjectMeta(key, None, ByteMeta(fname, off, 96, (0,))))
            off += 96
        cursor[(owner, "extra")] = off
        writes.append(RankWrite([], boxes, objects, box_columns(boxes)))  # as a rank would
    # Files go to the rank that writes them (the host's first rank for a host file).
    for (owner, kind), size in sorted(cursor.items()):
        tag = f"h{owner:05d}" if files_per == "host" else f"{owner:05d}"
        rank = owner * layout.ranks_per_host if files_per == "host" else owner
        writes[rank].files.append(FileMeta(f"{kind}-{tag}.safetensors", size, rank, kind))
    return writes


# -- file-system metadata operations ------------------------------------------------------------


@dataclass(frozen=True)
class FsOps:
    """Metadata-server operations of one save, as HDFS counts them: per file a create and a
    complete, one block allocation per started block; plus the staging directory, its rename,
    the metadata file and the ``latest`` pointer."""

    files: int
    creates: int
    blocks: int
    total: int


def count_fs_ops(file_sizes: list[int], *, block_bytes: int = 128 << 20, metadata_bytes: int = 0) -> FsOps:
    sizes = np.asarray(file_sizes + [metadata_bytes], dtype=np.int64)
    blocks = int(np.maximum(1, -(-sizes // block_bytes)).sum())
    files = len(sizes)
    # mkdir staging + rename + latest (create, complete, rename)
    total = 2 * files + blocks + 2 + 3
    return FsOps(files, files, blocks, total)


# -- the simulation ------------------------------------------------------------------------------


@dataclass
class StageResult:
    seconds: float
    peak_mib: float | None = None  # tracemalloc peak of the stage


@dataclass
class SimulationReport:
    world: int
    layout: Layout
    offered_boxes: int
    metadata_boxes: int
    tensors: int
    stages: dict[str, StageResult] = field(default_factory=dict)
    metadata_bytes: int = 0
    files: dict[str, FsOps] = field(default_factory=dict)
    rss_mib: float = 0.0

    @property
    def planning_s(self) -> float:
        """Global planning as the targets count it: plan + metadata template and build + encode."""
        return sum(self.stages[s].seconds for s in ("plan", "template", "build", "encode"))


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _stage(report: SimulationReport, name: str, fn: Callable[[], Any], memory: bool) -> Any:
    gc.collect()
    if memory:
        import tracemalloc

        tracemalloc.start()
    t = time.perf_counter()
    try:
        out = fn()
    finally:
        seconds = time.perf_counter() - t
        peak = None
        if memory:
            import tracemalloc

            peak = tracemalloc.get_traced_memory()[1] / 2**20
            tracemalloc.stop()
    report.stages[name] = StageResult(seconds, peak)
    return out


def simulate(spec: ModelSpec, layout: Layout, *, files_per: str = "rank", memory: bool = False,
             plans: list[LocalSavePlan] | None = None) -> SimulationReport:
    """Run the coordinator's planning and metadata code on synthetic plans of ``layout``.

    Stages: ``plan`` (dedup, balance, coverage: ``plan_save``), ``template`` (metadata
    geometry, kept in the plan cache), ``build`` (the metadata from the ranks' writes),
    ``encode``, ``decode`` (a load's first step), ``cached`` (what a plan-cache hit costs the
    coordinator: the shared-object check and the metadata from the cached template).
    ``memory=True`` also records each stage's peak allocation (tracemalloc; slower)."""
    from .save_metadata import build_metadata, metadata_template

    if plans is None:
        plans = local_plans(spec, layout)
    report = SimulationReport(layout.world, layout, sum(len(p.items) for p in plans), 0, 0)
    plan = _stage(report, "plan", lambda: plan_save(plans), memory)
    writes = synthetic_writes(plan, layout, files_per=files_per)
    template = _stage(report, "template", lambda: metadata_template(plan, writes), memory)
    meta_kwargs = dict(framework="megatron", world_size=layout.world,
                       layout={"tp": layout.tp, "pp": layout.pp, "dp": layout.dp}, step=1000,
                       user_metadata={}, chunk_bytes=DEFAULT_CHUNK_BYTES)
    meta = _stage(report, "build", lambda: build_metadata(template, writes, **meta_kwargs), memory)
    raw = _stage(report, "encode", meta.to_bytes, memory)
    _stage(report, "decode", lambda: CheckpointMetadata.from_bytes(raw), memory)

    def cached() -> CheckpointMetadata:
        check_shared_objects([p.shared for p in plans])
        return build_metadata(template, writes, **meta_kwargs)

    _stage(report, "cached", cached, memory)
    report.metadata_bytes = len(raw)
    report.metadata_boxes = len(meta.boxes)
    report.tensors = len(meta.tensors)
    for mode in ("rank", "host"):
        w = writes if mode == files_per else synthetic_writes(plan, layout, files_per=mode)
        sizes = [f.size for rw in w for f in rw.files]
        report.files[mode] = count_fs_ops(sizes, metadata_bytes=len(raw))
    report.rss_mib = _rss_mib()
    return report


def growth_exponent(n1: float, t1: float, n2: float, t2: float) -> float:
    """``k`` in t ∝ n^k between two sizes."""
    return math.log(t2 / t1) / math.log(n2 / n1)


def nlogn_exponent(n1: float, n2: float) -> float:
    """The exponent n·log n shows between two sizes (a little above 1)."""
    return growth_exponent(n1, n1 * math.log(n1), n2, n2 * math.log(n2))


__all__ = ["LLAMA_405B", "Layout", "ModelSpec", "SimulationReport", "count_fs_ops", "growth_exponent",
           "local_plans", "nlogn_exponent", "simulate", "synthetic_writes"]
