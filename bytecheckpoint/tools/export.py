"""Hugging Face safetensors export and import.

Export merges a checkpoint's shards into full tensors and writes them as Hugging Face
style shards::

    OUT/model-00001-of-00003.safetensors ...   at most ``max_shard_bytes`` of tensors each
    OUT/model.safetensors.index.json           {"metadata": {"total_size": N}, "weight_map": {...}}
    OUT/config.json                            from --config or the checkpoint's user metadata
    OUT/optimizer-0000k-of-0000n.safetensors   only with include_optimizer (own index file)

Every full tensor is read through the library's own resharding load (one process, no
process group): the tensors of one output shard are loaded together into full-size
``TensorShard`` targets, written, and dropped, so memory stays about one output shard.

Optimizer tensors go into a separate set of files (``optimizer-*.safetensors`` with
``optimizer.safetensors.index.json``) named ``<parameter name>.<state name>`` (for example
``transformer.h.0.attn.c_attn.weight.exp_avg``), so ``from_pretrained`` never sees them.

Tied weights (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are written once: a
name listed as tied is dropped when it is bit-identical to another tensor of the checkpoint,
and the pair is recorded in the index metadata (``bcp_tied``) so ``import`` restores it.

Import reads a Hugging Face directory (an index and its shards, or one ``model.safetensors``)
without unpickling anything and writes a bytecheckpoint checkpoint from one writer, every
tensor as one full box, which ``bytecheckpoint.load`` reshards into any layout.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ..commit.integrity import check_file_sizes, read_metadata, resolve
from ..errors import CheckpointError, CheckpointExistsError, UnsupportedStateError
from ..format.dtypes import byte_view, dtype_from_name, dtype_name
from ..format.metadata import CheckpointMetadata, TensorMeta
from ..state.tensor_shard import TensorShard

MODEL_INDEX = "model.safetensors.index.json"
OPTIM_INDEX = "optimizer.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
HF_CONFIG_KEY = "hf_config"  # user_metadata key holding a Hugging Face config dict
TIED_META_KEY = "bcp_tied"  # index metadata: "dropped=kept,dropped2=kept2"
DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's own default (5GB)
DEFAULT_TIED = ("lm_head.weight",)

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}

# --dtype names accepted on the command line
DTYPE_ALIASES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
                 "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16", "fp64": "float64",
                 "float64": "float64"}


class ExportError(CheckpointError):
    """An export or import cannot proceed (bad option, name clash, unusable input)."""


def parse_size(text: str | int) -> int:
    """``"2GB"`` -> 2_000_000_000, ``"500MiB"`` -> 524_288_000, ``1024`` -> 1024 (as Hugging Face)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m or (m.group(2) or "").lower() not in _UNITS:
            raise ExportError(f"size {text!r} is not understood; write it like 2GB, 500MB, 1GiB or 1048576")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if value <= 0:
        raise ExportError(f"size {text!r} must be positive")
    return value


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    canonical = DTYPE_ALIASES.get(name.lower())
    if canonical is None:
        raise ExportError(f"--dtype {name!r} is not one of {', '.join(sorted(DTYPE_ALIASES))}")
    return dtype_from_name(canonical)


@dataclass(frozen=True)
class NameMap:
    """How checkpoint FQNs become exported names: strip prefixes, then regex renames, in order."""

    strip_prefixes: tuple[str, ...] = ()
    renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, strip_prefixes: Iterable[str] = (), renames: Iterable[str] = ()) -> NameMap:
        pairs = []
        for r in renames:
            if "=" not in r:
                raise ExportError(f"--rename {r!r} must look like OLD=NEW (OLD is a regular expression)")
            old, new = r.split("=", 1)
            try:
                re.compile(old)
            except re.error as exc:
                raise ExportError(f"--rename {r!r}: {old!r} is not a valid regular expression "
                                  f"({exc})") from None
            pairs.append((old, new))
        return cls(tuple(strip_prefixes), tuple(pairs))

    def __call__(self, name: str) -> str:
        for p in self.strip_prefixes:
            if p and name.startswith(p):
                name = name[len(p):]
                break
        for old, new in self.renames:
            name = re.sub(old, new, name)
        return name


@dataclass(frozen=True)
class ExportItem:
    key: str  # checkpoint key, e.g. model/transformer.h.0.attn.c_attn.weight
    name: str  # exported name
    meta: TensorMeta
    out_dtype: torch.dtype

    @property
    def out_bytes(self) -> int:
        return math.prod(self.meta.shape) * self.out_dtype.itemsize


@dataclass
class ExportResult:
    out_dir: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    tied: dict[str, str] = field(default_factory=dict)  # dropped name -> the kept twin
    config_written: bool = False


Progress = Callable[[str, int], None]  # (description, bytes done in this call)


# Dtypes bytecheckpoint stores that safetensors has no code for (it has C64, not C128).
_NO_SAFETENSORS = frozenset({torch.complex128})


def _items(meta: CheckpointMetadata, group: str, names: NameMap, dtype: torch.dtype | None,
           kind: str) -> list[ExportItem]:
    out: list[ExportItem] = []
    seen: dict[str, str] = {}
    for t in meta.tensors:
        if t.group != group:
            continue
        rest = t.key[len(group) + 1:]
        if kind == "optim":
            # optimizer/state/<fqn>/<state name>: the FQN may hold dots but never '/'
            parts = rest.split("/")
            if len(parts) != 3 or parts[0] != "state":
                continue
            name = f"{names(parts[1])}.{parts[2]}"
        else:
            name = names(rest)
        if not name:
            raise ExportError(f"{t.key}: renaming leaves an empty name; check --strip-prefix/--rename")
        if name in seen:
            raise ExportError(f"{t.key} and {seen[name]} would both be exported as {name!r}; "
                              "adjust --strip-prefix/--rename")
        seen[name] = t.key
        src = dtype_from_name(t.dtype)
        out_dtype = dtype if (dtype is not None and src.is_floating_point) else src
        if out_dtype in _NO_SAFETENSORS:
            raise ExportError(f"{t.key} is a {str(out_dtype).replace('torch.', '')} tensor, which "
                              "safetensors cannot hold (it has no such dtype); nothing was written. "
                              "Export a checkpoint without it, or convert the tensor first (e.g. "
                              "torch.view_as_real, then save and export)")
        out.append(ExportItem(t.key, name, t, out_dtype))
    return out


def _pack(items: Sequence[ExportItem], limit: int) -> list[list[ExportItem]]:
    """Greedy in checkpoint order; a tensor larger than the limit gets a shard of its own.

    Not ``huggingface_hub.split_torch_state_dict_into_shards``: it splits the same way while
    every tensor fits (tests/unit/test_export_layout.py checks that), but it lifts a tensor larger
    than the limit out ahead while the open shard keeps filling, so the files stop following
    checkpoint order (a small tensor lands after every large one), and it names a single shard
    ``model.safetensors``, where this export always writes numbered shards and an index (which
    also carries ``bcp_tied``; docs/cli.md).
    """
    shards: list[list[ExportItem]] = []
    size = 0
    for it in items:
        if not shards or (size + it.out_bytes > limit and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it.out_bytes
    return shards


def _load_full(url: str, keys: Sequence[tuple[str, TensorMeta]]) -> dict[str, torch.Tensor]:
    """Full tensors of ``keys`` through the library's resharding load (one process)."""
    from ..api import load

    targets: dict[str, dict[str, TensorShard]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, meta in keys:
        group, rest = key.split("/", 1)
        data = torch.empty(meta.shape, dtype=dtype_from_name(meta.dtype))
        targets.setdefault(group, {})[rest] = TensorShard(data, tuple(meta.shape))
        out[key] = data
    load(url, targets, framework="manual", strict=False)
    return out


def _digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    flat = byte_view(t.contiguous()).numpy()
    return (xxhash.xxh3_128_hexdigest(flat), tuple(t.shape), dtype_name(t.dtype))


def _find_tied(url: str, items: list[ExportItem], tied: Sequence[str]) -> dict[str, str]:
    """``{dropped: kept}`` for each tied name that is bit-identical to another exported tensor
    (one candidate tensor in memory at a time, besides the tied one)."""
    by_name = {it.name: it for it in items}
    found: dict[str, str] = {}
    for name in tied:
        it = by_name.get(name)
        if it is None:
            continue
        candidates = [c for c in items if c.name != name and c.name not in found
                      and c.meta.shape == it.meta.shape and c.meta.dtype == it.meta.dtype]
        if not candidates:
            continue
        mine = _digest(_load_full(url, [(it.key, it.meta)])[it.key])
        for c in candidates:
            if _digest(_load_full(url, [(c.key, c.meta)])[c.key]) == mine:
                found[name] = c.name
                break
    return found


def _shard_name(prefix: str, i: int, n: int) -> str:
    return f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_set(url: str, out_tmp: str, prefix: str, index_name: str, items: list[ExportItem],
               limit: int, extra_meta: dict[str, str], progress: Progress | None) -> list[str]:
    from safetensors.torch import save_file

    shards = _pack(items, limit)
    weight_map: dict[str, str] = {}
    files = []
    total = 0
    for i, shard in enumerate(shards):
        fname = _shard_name(prefix, i, len(shards))
        loaded = _load_full(url, [(it.key, it.meta) for it in shard])
        tensors: dict[str, torch.Tensor] = {}
        for it in shard:
            t = loaded.pop(it.key)
            tensors[it.name] = t if t.dtype == it.out_dtype else t.to(it.out_dtype)
            weight_map[it.name] = fname
            total += it.out_bytes
        save_file(tensors, os.path.join(out_tmp, fname), metadata={"format": "pt"})
        files.append(fname)
        if progress is not None:
            progress(fname, sum(it.out_bytes for it in shard))
        del tensors, loaded
    index = {"metadata": {"total_size": total, **extra_meta}, "weight_map": weight_map}
    with open(os.path.join(out_tmp, index_name), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return files + [index_name]


def plan_export(url: str, *, model_key: str = "model", include_optimizer: bool = False,
                optimizer_key: str = "optimizer", names: NameMap | None = None,
                dtype: torch.dtype | None = None) -> tuple[str, CheckpointMetadata, list[ExportItem],
                                                           list[ExportItem]]:
    """Resolve the checkpoint and list what an export writes (no tensor is read)."""
    storage, path = resolve(url)
    meta = read_metadata(storage, path)  # validated: every tensor tiled, every range in its file
    # Declared sizes against the files' real sizes (and headers) before anything is allocated:
    # the tensors then hold at most the bytes the files do, and the load below checks that it
    # fills every element (an export never writes memory a load did not fill).
    check_file_sizes(storage, path, meta, {f.name for f in meta.files}, headers=True)
    names = names or NameMap()
    model = _items(meta, model_key, names, dtype, "model")
    if not model:
        groups = sorted({t.group for t in meta.tensors})
        raise ExportError(f"{storage.url(path)} holds no tensors under {model_key!r} (it has: "
                          f"{', '.join(groups) or 'none'}); pass --model-key")
    optim = _items(meta, optimizer_key, names, dtype, "optim") if include_optimizer else []
    if include_optimizer and not optim:
        raise ExportError(f"{storage.url(path)} holds no optimizer state under {optimizer_key!r}")
    return storage.url(path), meta, model, optim


def export_safetensors(
    url: str,
    out_dir: str,
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    names: NameMap | None = None,
    include_optimizer: bool = False,
    model_key: str = "model",
    optimizer_key: str = "optimizer",
    config: str | None = None,
    tied: Sequence[str] | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the checkpoint at ``url`` (a checkpoint or a root with ``latest``) as a Hugging
    Face model directory ``out_dir``. ``tied`` names (default ``lm_head.weight`` unless the
    config says ``tie_word_embeddings: false``) are written once. The directory appears
    complete or not at all (built beside it, then renamed)."""
    source, meta, model, optim = plan_export(url, model_key=model_key, include_optimizer=include_optimizer,
                                             optimizer_key=optimizer_key, names=names, dtype=dtype)
    cfg = _config(meta, config)
    if tied is None:
        tied = DEFAULT_TIED if (cfg or {}).get("tie_word_embeddings", True) else ()
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise CheckpointExistsError(f"{out_dir} exists and is not empty; choose another directory "
                                    "or pass --overwrite")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.export-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    result = ExportResult(out_dir)
    try:
        result.tied = _find_tied(source, model, tied)
        model = [it for it in model if it.name not in result.tied]
        extra = {TIED_META_KEY: ",".join(f"{k}={v}" for k, v in result.tied.items())} if result.tied else {}
        result.files += _write_set(source, tmp, "model", MODEL_INDEX, model, max_shard_bytes, extra, progress)
        if optim:
            result.files += _write_set(source, tmp, "optimizer", OPTIM_INDEX, optim, max_shard_bytes, {},
                                       progress)
        if cfg is not None:
            with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
                f.write("\n")
            result.files.append(CONFIG_FILE)
            result.config_written = True
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    result.tensors = len(model) + len(optim)
    result.bytes = sum(it.out_bytes for it in model + optim)
    return result


def _config(meta: CheckpointMetadata, path: str | None) -> dict[str, Any] | None:
    if path:
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as exc:
            raise ExportError(f"--config {path}: cannot read it as JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ExportError(f"--config {path}: not a JSON object")
        return doc
    doc = meta.user_metadata.get(HF_CONFIG_KEY)
    return dict(doc) if isinstance(doc, dict) else None


# -- import ------------------------------------------------------------------------------------

@dataclass
class ImportResult:
    path: str
    tensors: int
    bytes: int
    tied: dict[str, str]


def _safe_member(src_dir: str, name: str) -> str:
    """A shard named by an index must be a plain file inside the model directory."""
    if not isinstance(name, str) or os.path.basename(name) != name or name.startswith("."):
        raise ExportError(f"{src_dir}: the index names {name!r}, which is not a plain file name in the "
                          "directory; refusing to read it")
    return os.path.join(src_dir, name)


def read_hf_dir(src_dir: str) -> tuple[list[str], dict[str, str], dict[str, Any] | None]:
    """The shard files of a Hugging Face directory, its tied pairs and its config."""
    index_path = os.path.join(src_dir, MODEL_INDEX)
    tied: dict[str, str] = {}
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                index = json.load(f)
            weight_map = index["weight_map"]
            files = sorted(set(weight_map.values()))
            raw = str((index.get("metadata") or {}).get(TIED_META_KEY, ""))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ExportError(f"{index_path}: not a readable safetensors index ({exc})") from None
        tied = dict(p.split("=", 1) for p in raw.split(",") if "=" in p)
        paths = [_safe_member(src_dir, n) for n in files]
    elif os.path.isfile(os.path.join(src_dir, SINGLE_FILE)):
        paths = [os.path.join(src_dir, SINGLE_FILE)]
    else:
        raise ExportError(f"{src_dir} is not a Hugging Face model directory: it has neither "
                          f"{MODEL_INDEX} nor {SINGLE_FILE}")
    for p in paths:
        if not os.path.isfile(p):
            raise ExportError(f"{p}: named by the index but missing")
    cfg = None
    cfg_path = os.path.join(src_dir, CONFIG_FILE)
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as exc:
            raise ExportError(f"{cfg_path}: not valid JSON ({exc})") from None
    return paths, tied, cfg


def import_safetensors(
    src_dir: str,
    dst_url: str,
    *,
    model_key: str = "model",
    names: NameMap | None = None,
    tie: dict[str, str] | None = None,
    step: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ImportResult:
    """Write the Hugging Face directory ``src_dir`` as a checkpoint at ``dst_url``.

    ``tie`` maps a name to add to the name whose tensor it shares (default: what the export's
    index recorded). The whole model is held in memory once (one writer)."""
    from safetensors import safe_open

    from ..api import save

    names = names or NameMap()
    paths, recorded_tied, cfg = read_hf_dir(src_dir)
    tie = dict(recorded_tied if tie is None else tie)
    tensors: dict[str, torch.Tensor] = {}
    for p in paths:
        try:
            with safe_open(p, framework="pt") as f:
                for name in f.keys():
                    new = names(name)
                    if new in tensors:
                        raise ExportError(f"{p}: {name!r} becomes {new!r}, which another tensor already has")
                    tensors[new] = f.get_tensor(name)
        except ExportError:
            raise
        except Exception as exc:  # the safetensors reader's own errors (bad header, truncation)
            raise ExportError(f"{p}: not a readable safetensors file ({exc})") from None
        if progress is not None:
            progress(os.path.basename(p), os.path.getsize(p))
    for dropped, kept in tie.items():
        if dropped not in tensors:
            if kept not in tensors:
                raise ExportError(f"tied pair {dropped}={kept}: {kept!r} is not in {src_dir}")
            tensors[dropped] = tensors[kept]
    for name, t in tensors.items():
        try:
            dtype_name(t.dtype)
        except UnsupportedStateError as exc:
            raise ExportError(f"{name}: {exc}") from None
    shards = {name: TensorShard(t, tuple(t.shape)) for name, t in tensors.items()}
    meta: dict[str, Any] = {"imported_from": os.path.abspath(src_dir)}
    if cfg is not None:
        meta[HF_CONFIG_KEY] = cfg
    save(dst_url, {model_key: shards}, framework="manual", step=step, user_metadata=meta, overwrite=overwrite)
    return ImportResult(dst_url, len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()),
                        tie)
