"""The seed checkpoint every file-level fuzz case starts from, and the load oracle.

The seed is a real, tiny save: two linear layers, AdamW with two parameter groups after one
step, and a per-rank extra-state dict, written by ``bcp.save`` in one process. A case
replaces one file of a copy (the metadata, a storage file), loads into a fresh state whose
every value differs from the saved one, and classifies what happened.

The oracle does not trust the library's decoder: :func:`expected_from_doc` reads the
(mutated) metadata document with plain msgpack + numpy and computes what a load *must*
return, or that it must fail (a box outside its tensor or file, a tensor not covered exactly
once, a checksum that does not match). A load that succeeds must return exactly that.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

import bytecheckpoint as bcp
from bytecheckpoint.format import codec
from bytecheckpoint.format.metadata import METADATA_FILE
from tests.fuzz import seal
from tests.fuzz.outcomes import NAMED, OK, RAW, WRONG, Result, classify

_NP_DTYPES = {"float32": np.float32}
_FRESH_LR = 0.5


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _optimizer(model: torch.nn.Module, lrs: tuple[float, float]) -> torch.optim.Optimizer:
    first, second = model[0], model[1]
    return torch.optim.AdamW([{"params": first.parameters(), "lr": lrs[0]},
                              {"params": second.parameters(), "lr": lrs[1]}])


def saved_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = _model()
    optim = _optimizer(model, (0.1, 0.01))
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    return {"model": model, "optimizer": optim,
            "extra": {"step": 3, "note": "seed", "t": torch.arange(3), "nested": {1: (2.5, None)}}}


def fresh_state() -> dict[str, Any]:
    """A state to load into: every tensor and value differs from the saved one."""
    torch.manual_seed(99)
    model = _model()
    return {"model": model, "optimizer": _optimizer(model, (_FRESH_LR, _FRESH_LR)),
            "extra": {"sentinel": True}}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Checkpoint key -> value for everything a load must restore (tensors as raw bytes)."""
    model, optim = state["model"], state["optimizer"]
    out: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        out[f"model/{name}"] = _tensor_key(t)
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optim.param_groups:
        hparams = codec.encode({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            out[f"optimizer/param_groups/{names[id(p)]}"] = hparams
            for k, v in optim.state.get(p, {}).items():
                out[f"optimizer/state/{names[id(p)]}/{k}"] = _tensor_key(v)
    out["extra"] = codec.encode(state["extra"])
    return out


def _tensor_key(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    t = t.detach().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return (str(t.dtype).replace("torch.", ""), tuple(t.shape), raw)


@dataclass
class Seed:
    """A saved checkpoint kept in memory: its files and what a load of it must return."""

    files: dict[str, bytes]
    reference: dict[str, Any]

    @property
    def doc(self) -> dict:
        return seal.decode_doc(self.files[METADATA_FILE])

    def file_named(self, name: str) -> str:
        """``name``, or the seed's storage file of the same kind (``model-...``) when the
        library names files differently (cases and the corpus keep working)."""
        if name in self.files:
            return name
        kind = name.split("-", 1)[0] + "-"
        return next(n for n in sorted(self.files) if n.startswith(kind))

    def write(self, path: str, replace: dict[str, bytes] | None = None) -> None:
        """Materialise the checkpoint at ``path`` with some files replaced."""
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path)
        for name, data in {**self.files, **(replace or {})}.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)


def build_seed(workdir: str) -> Seed:
    path = os.path.join(workdir, "seed")
    state = saved_state()
    bcp.save(path, state, step=1)
    files = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            files[name] = f.read()
    shutil.rmtree(path)
    return Seed(files, snapshot(state))


# -- the oracle --------------------------------------------------------------------------------------

class MustFail(Exception):
    """The reference reader found the metadata unusable: no load of it may succeed."""


def _col(doc: dict, group: str, name: str, fmt: str) -> np.ndarray:
    raw = doc[group][name]
    if not isinstance(raw, bytes) or len(raw) % np.dtype(fmt).itemsize:
        raise MustFail(f"{group}.{name} is not a column")
    return np.frombuffer(raw, dtype=fmt).astype(np.int64 if fmt != "<u8" else np.uint64)


def expected_from_doc(doc: Any, files: dict[str, bytes], reference: dict[str, Any]) -> dict[str, Any]:
    """What loading ``doc`` (a decoded metadata document) into the seed's state must return.

    Raises MustFail when no load may succeed. Only the keys of ``reference`` are computed:
    they are what the state holds."""
    try:
        return _expected(doc, files, reference)
    except MustFail:
        raise
    except Exception as exc:  # any field of the wrong shape or type: the document is unusable
        raise MustFail(f"reference reader: {exc!r}") from exc


def _expected(doc: dict, files: dict[str, bytes], reference: dict[str, Any]) -> dict[str, Any]:
    if doc.get("format") != "bytecheckpoint" or doc["checksum"]["algorithm"] != "xxh3_64":
        raise MustFail("format or checksum algorithm")
    chunk = doc["checksum"]["chunk_bytes"]
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise MustFail("chunk size")
    world = doc["world_size"]
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise MustFail("world size")
    file_list = doc["files"]
    names = [f[0] for f in file_list]
    declared = {f[0]: f[1] for f in file_list}

    def data_of(file_name: Any, offset: Any, length: Any) -> bytes:
        if file_name not in files or declared.get(file_name) != len(files[file_name]):
            raise MustFail(f"file {file_name!r} missing or of another size")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length)):
            raise MustFail("byte range is not integers")
        if offset < 0 or length < 0 or offset + length > len(files[file_name]):
            raise MustFail("byte range outside its file")
        return files[file_name][offset:offset + length]

    def check_sums(data: bytes, sums: list[int]) -> None:
        got = [xxhash.xxh3_64_intdigest(data[i:i + chunk]) for i in range(0, len(data), chunk)]
        if [int(s) for s in sums] != got:
            raise MustFail("checksum mismatch")

    keys, dtypes = doc["tensors"]["key"], doc["tensors"]["dtype"]
    ndim = _col(doc, "tensors", "ndim", "<i4")
    shape_flat = _col(doc, "tensors", "shape", "<i8")
    if len(ndim) != len(keys) or len(dtypes) != len(keys) or (ndim < 0).any() \
            or ndim.sum() != len(shape_flat):
        raise MustFail("tensor columns")
    starts = np.concatenate([[0], np.cumsum(ndim)[:-1]]).astype(np.int64)
    b_tensor = _col(doc, "boxes", "tensor", "<i4")
    offsets, lengths = _col(doc, "boxes", "offsets", "<i8"), _col(doc, "boxes", "lengths", "<i8")
    b_file, b_off = _col(doc, "boxes", "file", "<i4"), _col(doc, "boxes", "byte_offset", "<i8")
    b_len, sums = _col(doc, "boxes", "byte_length", "<i8"), _col(doc, "boxes", "checksums", "<u8")
    n = len(b_tensor)
    if not (len(b_file) == len(b_off) == len(b_len) == n) or ((b_tensor < 0) | (b_tensor >= len(keys))).any():
        raise MustFail("box columns")
    box_ndim = ndim[b_tensor] if n else np.zeros(0, dtype=np.int64)
    if int(box_ndim.sum()) != len(offsets) or len(lengths) != len(offsets):
        raise MustFail("box dims")
    dim_start = np.concatenate([[0], np.cumsum(box_ndim)[:-1]]).astype(np.int64)
    n_chunks = [max(1, -(-int(L) // chunk)) if L > 0 else 0 for L in b_len]
    if sum(n_chunks) != len(sums):
        raise MustFail("checksum column")
    sum_start = np.concatenate([[0], np.cumsum(n_chunks)[:-1]]).astype(np.int64) if n else []

    out: dict[str, Any] = {}
    for key, (dtype, shape, _) in ((k, v) for k, v in reference.items() if isinstance(v, tuple)):
        if keys.count(key) != 1:
            raise MustFail(f"{key}: {keys.count(key)} entries")
        i = keys.index(key)
        d_shape = tuple(int(x) for x in shape_flat[starts[i]:starts[i] + ndim[i]])
        if dtypes[i] != dtype or d_shape != shape:
            raise MustFail(f"{key}: dtype/shape differ from the state")
        np_dtype = _NP_DTYPES[dtype]
        filled = np.zeros(shape, dtype=np.int64)
        value = np.zeros(shape, dtype=np_dtype)
        for b in np.nonzero(b_tensor == i)[0]:
            o = offsets[dim_start[b]:dim_start[b] + ndim[i]]
            L = lengths[dim_start[b]:dim_start[b] + ndim[i]]
            if (o < 0).any() or (L < 0).any() or (o + L > np.array(shape, dtype=np.int64)).any():
                raise MustFail(f"{key}: box outside the tensor")
            count = math.prod(int(x) for x in L)
            if count * np.dtype(np_dtype).itemsize != b_len[b] or not 0 <= b_file[b] < len(names):
                raise MustFail(f"{key}: box byte length or file")
            raw = data_of(names[b_file[b]], int(b_off[b]), int(b_len[b]))
            check_sums(raw, sums[sum_start[b]:sum_start[b] + n_chunks[b]].tolist())
            region = tuple(slice(int(a), int(a + m)) for a, m in zip(o, L))
            value[region] = np.frombuffer(raw, dtype=np_dtype).reshape(tuple(int(x) for x in L))
            filled[region] += 1
        if not (filled == 1).all():
            raise MustFail(f"{key}: not covered exactly once")
        out[key] = (dtype, shape, value.tobytes())

    source_rank = 0  # one loading rank: rank 0's per-rank objects, or shared ones
    for key in (k for k, v in reference.items() if isinstance(v, bytes)):
        per_rank = key == "extra"
        found = [o for o in doc["objects"]
                 if o[0] == key and (o[1] == source_rank if per_rank else o[1] is None)]
        values = set()
        for o in found:
            raw = data_of(o[2], o[3], o[4])
            check_sums(raw, o[5])
            try:
                values.add(codec.encode(codec.decode(raw)))
            except bcp.CheckpointError as exc:
                raise MustFail(f"{key}: object does not decode") from exc
        if len(values) != 1:
            raise MustFail(f"{key}: {len(values)} distinct stored values")
        out[key] = values.pop()
    return out


def load_case(path: str, reference: dict[str, Any], doc: Any | None) -> Result:
    """Load ``path`` into a fresh state and classify the outcome.

    ``doc`` is the metadata document the files on disk carry (None: the seed's own, so the
    load must return ``reference``)."""
    state = fresh_state()
    try:
        bcp.load(path, state, verify=True)
    except Exception as exc:  # noqa: BLE001 - classifying it is the point
        return classify(exc)
    got = snapshot(state)
    if doc is None:
        expected = reference
    else:
        try:
            expected = expected_from_doc(doc, _files_of(path), reference)
        except MustFail as why:
            return Result(WRONG, f"load succeeded but the metadata is unusable: {why}")
    for key, want in expected.items():
        if got.get(key) != want:
            return Result(WRONG, f"{key}: loaded value differs from what the checkpoint holds")
    return Result(OK)


def _files_of(path: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                out[name] = f.read()
    return out


def metadata_case(seed: Seed, path: str, data: bytes) -> Result:
    """The seed with its metadata file replaced by ``data``."""
    seed.write(path, {METADATA_FILE: data})
    try:
        doc = seal.decode_doc(data)
    except Exception:  # noqa: BLE001 - undecodable: no load may succeed; expected_from_doc says so
        doc = {}
    return load_case(path, seed.reference, doc)


def storage_case(seed: Seed, path: str, name: str, data: bytes) -> Result:
    """The seed with storage file ``name`` replaced by ``data``: the checksums and sizes in the
    (untouched) metadata must catch every change a load would use."""
    seed.write(path, {name: data})
    return load_case(path, seed.reference, seed.doc)


def safetensors_parts(data: bytes) -> tuple[Any, bytes]:
    """(parsed header or None when unreadable, payload bytes) of a storage file. The header's
    ``__metadata__`` (free-form notes: format, rank, kind) is left out: no reader takes data
    through it, and verify does not check it (docs/threat-model.md)."""
    try:
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 + n:
            return None, data
        header = json.loads(data[8:8 + n])
        if isinstance(header, dict):
            header.pop("__metadata__", None)
        return header, data[8 + n:]
    except ValueError:
        return None, data


def verify_case(seed: Seed, path: str, name: str, data: bytes) -> Result:
    """``bcp.verify`` of the seed with storage file ``name`` replaced: a change that alters what
    the file says (payload bytes, or a header entry) must be reported, never pass."""
    seed.write(path, {name: data})
    try:
        problems = bcp.verify(path)
    except Exception as exc:  # noqa: BLE001
        return classify(exc)
    if safetensors_parts(data) != safetensors_parts(seed.files[name]) and not problems:
        return Result(WRONG, f"verify passed a changed {name}")
    return Result(OK)


__all__ = ["Seed", "build_seed", "metadata_case", "storage_case", "verify_case", "load_case", "MustFail",
           "expected_from_doc", "OK", "NAMED", "RAW", "WRONG"]
