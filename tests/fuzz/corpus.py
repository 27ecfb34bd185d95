"""The seeded corpus under tests/fuzz/corpus/: cases every default run replays.

``python -m tests.fuzz.corpus`` regenerates it: the reproducers of issue 17's holes by name,
then cases drawn from seed 2024 for each target (the same draw as the long run). Cases are
mutations (ops), not mutated files, so they stay valid for any fresh save of the seed state.
A new finding of the long run is added here by name once fixed, so it can never come back.
"""

from __future__ import annotations

import os
import shutil
import sys

import msgpack

from tests.fuzz import cases, objects, session

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
SEED, PER_TARGET = 2024, 25


def named_cases(ctx: cases.Context) -> dict[str, list]:
    """Reproducers of the holes issue 17 lists, by name."""
    seed = ctx.seed
    model = seed.file_named("model-00000.safetensors")
    header = seed.files[model]
    f32 = header.index(b'"F32"') + 1
    optim = seed.files[seed.file_named("optim-00000.safetensors")]
    first_offset = int.from_bytes(seed.doc["boxes"]["byte_offset"][:8], "little", signed=True)
    return {
        "object-nested-ext-200": ["object", objects.nested_ext(200)],
        "object-nested-intkey-dict-5000": ["object", objects.nested_ext(5000, objects.EXT_INTKEY_DICT)],
        "object-nested-arrays-20k": ["object", objects.nested_arrays(20_000)],
        "object-tensor-shape-2p40-no-bytes": ["object", objects._ext(objects.EXT_TENSOR, msgpack.packb(
            ["float32", [2**40], b""], use_bin_type=True))],
        "object-bigint-5000-digits": ["object", objects._ext(objects.EXT_BIGINT, b"9" * 5000)],
        "object-in-checkpoint-nested-ext-200": ["object_checkpoint", objects.nested_ext(200)],
        "doc-box-covers-half-its-tensor": ["doc_ops", [("elem", ("boxes", "lengths"), 1, 1)]],
        # Two boxes at one byte offset: the read plan once keyed reads by it and skipped a weight.
        "doc-byte-offset-collides": ["doc_ops", [("elem", ("boxes", "byte_offset"), 1, first_offset)]],
        "doc-object-rank-flipped": ["doc_ops", [("set", ("objects", len(seed.doc["objects"]) - 1, 1), 1)]],
        "doc-object-rank-none": ["doc_ops", [("set", ("objects", len(seed.doc["objects"]) - 1, 1), None)]],
        # A shared object (a parameter's optimizer hyperparameters) given a rank was never read.
        "doc-shared-object-given-a-rank": ["doc_ops", [("set", ("objects", 1, 1), 0)]],
        "doc-tensor-2p24-rows": ["doc_ops", [("elem", ("tensors", "shape"), 0, 2**24)]],
        "doc-object-length-negative": ["doc_ops", [("set", ("objects", 0, 4), -5)]],
        "doc-object-length-huge": ["doc_ops", [("set", ("objects", 0, 4), 1_385_000_000)]],
        "doc-object-no-checksums": ["doc_ops", [("set", ("objects", 0, 5), [])]],
        "doc-file-name-escapes": ["doc_ops", [("set", ("files", 0, 0), "../escape")]],
        "doc-created-at-1e20": ["doc_ops", [("set", ("created_at",), 1e20)]],
        "doc-step-string": ["doc_ops", [("set", ("step",), "init")]],
        "verify-header-f32-to-i32": ["verify_ops", model, [("set", f32, ord("I"))]],
        "storage-header-f32-to-i32": ["storage_ops", model, [("set", f32, ord("I"))]],
        # Two same-shaped entries trade names: tools reading the file by name get each other's numbers.
        "verify-header-entry-names-swapped": ["verify_ops", "optim", [
            ("set", optim.index(b"state/0.bias/step@") + 6, ord("1")),
            ("set", optim.index(b"state/1.bias/step@") + 6, ord("0"))]],
        "storage-truncated": ["storage_ops", model, [("truncate", len(header) - 3)]],
        "spool-step-infinity": ["spool", [b'{"event_id": "a1", "name": "save.write", "step": Infinity}']],
        "spool-step-1e30": ["spool", [b'{"event_id": "a2", "name": "save.write", "step": 1' + b"0" * 30
                                         + b"}"]],
        "spool-pid-negative": ["spool", [b'{"event_id": "a3", "name": "save.write", "pid": -1}']],
        "cli-verify-fifo": ["cli", ["verify", "{ws}/fifo"]],
        "cli-verify-devnull": ["cli", ["verify", "{ws}/devnull"]],
        "cli-verify-threads-0": ["cli", ["verify", "{ws}/root", "--threads", "0"]],
        "cli-inspect-s3-no-bucket": ["cli", ["inspect", "s3://"]],
        "cli-gc-symlink-out-of-root": ["cli", ["gc", "{ws}/root", "--keep-last", "1", "--yes"]],
    }


def generate(path: str = CORPUS) -> int:
    ctx = session.context()
    if os.path.isdir(path):
        shutil.rmtree(path)
    items = [(f"named-{name}", case) for name, case in named_cases(ctx).items()]
    for target in cases.TARGETS:
        items += [(f"{target}-{i:03d}", cases.draw(target, cases.case_rng(SEED, target, i), ctx))
                  for i in range(PER_TARGET)]
    for name, case in items:
        folder = os.path.join(path, case[0].split("_")[0])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{name}.msgpack"), "wb") as f:
            f.write(msgpack.packb(case, use_bin_type=True))
    return len(items)


def load(*kinds: str) -> list[tuple[str, list]]:
    """(name, case) of every corpus file whose case kind starts with one of ``kinds``."""
    out = []
    for folder in sorted(os.listdir(CORPUS)) if os.path.isdir(CORPUS) else []:
        if not folder.startswith(kinds):
            continue
        for name in sorted(os.listdir(os.path.join(CORPUS, folder))):
            with open(os.path.join(CORPUS, folder, name), "rb") as f:
                out.append((name, msgpack.unpackb(f.read(), raw=False, strict_map_key=False)))
    return out


if __name__ == "__main__":
    print(f"wrote {generate()} cases under {CORPUS}", file=sys.stderr)
