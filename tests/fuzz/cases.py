"""Fuzz targets by name: how one case runs, and how the long run draws case ``i`` of a seed.

A case is plain data (msgpack-able), so the parent can send it to a guarded worker, store it
in the corpus and print it in a finding. ``draw(target, rng, ctx)`` makes one; ``run(target,
case, ctx)`` runs it in this process.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import xxhash

from bytecheckpoint.format.metadata import METADATA_FILE
from tests.fuzz import checkpoint as ck
from tests.fuzz import cli, mutate, objects, seal, spool
from tests.fuzz.outcomes import OK, Result

TARGETS = ("metadata", "metadata_doc", "storage", "verify", "object", "object_checkpoint", "spool", "cli")
# The long run's share of each target (mutations over the metadata, objects and spool first).
WEIGHTS = {"metadata": 20, "metadata_doc": 25, "storage": 6, "verify": 3, "object": 30,
           "object_checkpoint": 4, "spool": 10, "cli": 2}


@dataclass
class Context:
    """What a worker builds once: the seed checkpoint and a scratch directory."""

    workdir: str
    seed: ck.Seed
    workspace: cli.Workspace

    @classmethod
    def create(cls, workdir: str) -> Context:
        os.makedirs(workdir, exist_ok=True)
        seed = ck.build_seed(workdir)
        return cls(workdir, seed, cli.Workspace(os.path.join(workdir, "cli"), seed))

    @property
    def case_path(self) -> str:
        return os.path.join(self.workdir, "case")


def _storage_region(rng: random.Random, data: bytes) -> tuple[int, int] | None:
    header_end = 8 + int.from_bytes(data[:8], "little")
    return rng.choice(((0, header_end), (header_end, len(data)), None))


def draw(target: str, rng: random.Random, ctx: Context) -> list:
    """Case ``rng`` picks for ``target``: mutations are kept as ops, resolved against the seed
    when the case runs, so a case stays valid for any save of the seed state."""
    seed = ctx.seed
    if target == "metadata":
        return ["metadata_ops", mutate.random_byte_ops(rng, len(seed.files[METADATA_FILE]))]
    if target == "metadata_doc":
        return ["doc_ops", mutate.random_doc_ops(rng, seed.doc)]
    if target in ("storage", "verify"):
        name = rng.choice(sorted(n for n in seed.files if n != METADATA_FILE))
        data = seed.files[name]
        return [f"{target}_ops", name, mutate.random_byte_ops(rng, len(data), _storage_region(rng, data))]
    if target == "object":
        return ["object", objects.random_blob(rng)]
    if target == "object_checkpoint":
        return ["object_checkpoint", objects.random_blob(rng)]
    if target == "spool":
        return ["spool", [spool.random_line(rng) for _ in range(rng.randrange(1, 6))]]
    if target == "cli":
        return ["cli", cli.random_argv(rng, cli.PLACEHOLDER_PATHS)]
    raise ValueError(f"unknown fuzz target {target!r}")


def resolve(case: list, ctx: Context) -> list:
    """A case with its ops applied to the seed: what :func:`run` executes."""
    kind, seed = case[0], ctx.seed
    if kind == "metadata_ops":
        return ["metadata", mutate.apply_bytes(seed.files[METADATA_FILE], case[1])]
    if kind == "doc_ops":
        try:
            return ["metadata", seal.encode_doc(mutate.apply_doc(seed.doc, case[1]))]
        except (TypeError, ValueError, OverflowError):
            return ["metadata", seed.files[METADATA_FILE]]  # a value msgpack cannot encode
    if kind in ("storage_ops", "verify_ops"):
        name = seed.file_named(case[1])
        return [kind[:-4], name, mutate.apply_bytes(seed.files[name], case[2])]
    if kind == "cli":
        return ["cli", [ctx.workspace.expand(a) for a in case[1]]]
    return case


def with_object(seed: ck.Seed, blob: bytes) -> dict[str, bytes]:
    """The seed's files with the per-rank ``extra`` object replaced by ``blob``: appended to its
    storage file, the metadata entry and file size updated, the metadata re-sealed. Checksums
    match, so the load reaches the object decoder."""
    doc = seed.doc
    entry = next(o for o in doc["objects"] if o[0] == "extra")
    name = entry[2]
    data = seed.files[name] + blob
    chunk = doc["checksum"]["chunk_bytes"]
    entry[3:6] = [len(seed.files[name]), len(blob),
                  [xxhash.xxh3_64_intdigest(blob[i:i + chunk]) for i in range(0, len(blob), chunk)]]
    for f in doc["files"]:
        if f[0] == name:
            f[1] = len(data)
    return {METADATA_FILE: seal.encode_doc(doc), name: data}


def run(case: list, ctx: Context) -> Result:
    case = resolve(case, ctx)
    kind = case[0]
    if kind == "metadata":
        return ck.metadata_case(ctx.seed, ctx.case_path, case[1])
    if kind == "storage":
        return ck.storage_case(ctx.seed, ctx.case_path, case[1], case[2])
    if kind == "verify":
        return ck.verify_case(ctx.seed, ctx.case_path, case[1], case[2])
    if kind == "object":
        return objects.decode_case(case[1])
    if kind == "object_checkpoint":
        files = with_object(ctx.seed, case[1])
        ctx.seed.write(ctx.case_path, files)
        return ck.load_case(ctx.case_path, ctx.seed.reference, seal.decode_doc(files[METADATA_FILE]))
    if kind == "spool":
        return spool.spool_case(list(case[1]))
    if kind == "cli":
        ctx.workspace.build()
        return cli.cli_case(list(case[1]), ctx.workspace)
    raise ValueError(f"unknown case kind {kind!r}")


def case_rng(seed: int, target: str, index: int) -> random.Random:
    return random.Random(f"{seed}:{target}:{index}")


def describe(case: Any) -> str:
    """A short printable form of a case for reports (bytes shown by size and hash)."""
    def short(v: Any) -> Any:
        if isinstance(v, (bytes, bytearray)):
            return f"<{len(v)} bytes xxh3={xxhash.xxh3_64_hexdigest(bytes(v))}>"
        if isinstance(v, list):
            return [short(x) for x in v]
        return v
    return repr(short(case))[:400]


__all__ = ["TARGETS", "WEIGHTS", "Context", "draw", "run", "case_rng", "describe", "OK"]
