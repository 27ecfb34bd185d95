"""The on-disk format: metadata round trip, safe object codec, safetensors compatibility,
and the in-memory backend."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import bytecheckpoint as bcp
from bytecheckpoint.commit.integrity import read_metadata, resolve
from bytecheckpoint.errors import CorruptCheckpointError, UnsupportedStateError
from bytecheckpoint.format import codec
from bytecheckpoint.format.metadata import CheckpointMetadata
from tests.support import workloads as w
from tests.support.helpers import assert_same_state


def test_object_codec_round_trips_rng_and_optimizer_values():
    value = {
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "torch_rng": torch.get_rng_state(),
        "betas": (0.9, 0.95),
        "nested": {1: [None, True, 2.5, "x", b"\x00\xff"], (1, 2): torch.tensor(3.0)},
        "bf16": torch.arange(4, dtype=torch.bfloat16),
        "dtype": torch.float16,
    }
    back = codec.decode(codec.encode(value))
    assert back["python_rng"] == value["python_rng"]
    assert back["numpy_rng"][0] == "MT19937" and np.array_equal(back["numpy_rng"][1], value["numpy_rng"][1])
    assert torch.equal(back["torch_rng"], value["torch_rng"])
    assert back["betas"] == (0.9, 0.95) and back["dtype"] is torch.float16
    assert back["nested"][1] == value["nested"][1]
    assert torch.equal(back["nested"][(1, 2)], torch.tensor(3.0))
    assert torch.equal(back["bf16"], value["bf16"])
    random.setstate(back["python_rng"])  # really usable as an RNG state


def test_object_codec_refuses_unknown_types_and_garbage():
    with pytest.raises(UnsupportedStateError, match="cannot store a value of type"):
        codec.encode({"f": lambda: 1})
    with pytest.raises(CorruptCheckpointError):
        codec.decode(b"\xc7\x03\x63abc")  # an extension type we never write


def test_metadata_round_trip_and_storage_files_are_safetensors(tmp_path):
    model, optim = w.make_plain(seed=3)
    w.train_step(model, optim, 0, 0)
    bcp.save(str(tmp_path / "c"), {"model": model, "optimizer": optim},
             step=7, user_metadata={"run": "abc", "lr": 0.1})
    storage, path = resolve(str(tmp_path / "c"))
    meta = read_metadata(storage, path)
    again = CheckpointMetadata.from_bytes(meta.to_bytes())
    assert [t.key for t in again.tensors] == [t.key for t in meta.tensors]
    assert again.step == 7 and again.user_metadata == {"run": "abc", "lr": 0.1}
    for t in meta.tensors:
        assert again.boxes_of(t.key) == meta.boxes_of(t.key)
    # Every storage file opens with the safetensors library, entries equal to the model's.
    with safe_open(str(tmp_path / "c" / "model-00000.safetensors"), "pt") as f:
        assert f.get_tensor("model/head.weight@0,0").equal(model.head.weight)
    with safe_open(str(tmp_path / "c" / "optim-00000.safetensors"), "pt") as f:
        keys = list(f.keys())
        pieces = [k for k in keys if not k.startswith("__padding__/")]
        assert len(pieces) == len([t for t in meta.tensors if t.key.startswith("optimizer/")])
        assert len(pieces) < len(keys)  # AdamW's 4-byte steps leave the next piece off the boundary
        for k in keys:
            if k.startswith("__padding__/"):
                pad = f.get_tensor(k)
                assert pad.dtype == torch.uint8 and 0 < pad.numel() < 64 and not pad.any()


def test_every_piece_of_64_bytes_or_more_starts_on_a_64_byte_boundary(tmp_path):
    """The copy from the page cache into a (64-byte aligned) tensor runs at about a third of
    its speed when the file offset is off the cache line (see ``engine.files``)."""
    model, optim = w.make_plain(seed=3)
    w.train_step(model, optim, 0, 0)
    bcp.save(str(tmp_path / "c"), {"model": model, "optimizer": optim, "extra_state": {"note": "x" * 77}})
    storage, path = resolve(str(tmp_path / "c"))
    meta = read_metadata(storage, path)
    b = meta.boxes
    sizes = b.byte_length.tolist()
    starts = b.byte_offset.tolist() + [o.bytes.byte_offset for o in meta.objects]
    sizes += [o.bytes.byte_length for o in meta.objects]
    assert any(n % 64 for n in sizes) and len(sizes) > 20  # odd sizes were there to misalign
    assert all(start % 64 == 0 for start, n in zip(starts, sizes) if n >= 64)


def test_memory_backend_round_trip():
    model, optim = w.make_plain(seed=4)
    w.train_step(model, optim, 0, 0)
    ref = w.full_state(model, optim)
    bcp.save("mem://jobs/a/step_1", {"model": model, "optimizer": optim}, step=1)
    fresh, fresh_optim = w.make_plain(seed=5, lr=1.0)
    result = bcp.load("mem://jobs/a", {"model": fresh, "optimizer": fresh_optim})
    assert result.step == 1
    assert_same_state(ref, w.full_state(fresh, fresh_optim))
    assert bcp.verify("mem://jobs/a") == []


def test_wrapper_names_are_dropped_but_user_names_kept(tmp_path):
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 3)  # a user submodule that happens to be "module"
            self.head = torch.nn.Linear(3, 1)

    torch.manual_seed(0)
    saved = Model()
    bcp.save(str(tmp_path / "c"), {"model": torch.compile(saved)})
    storage, path = resolve(str(tmp_path / "c"))
    keys = [t.key for t in read_metadata(storage, path).tensors]
    assert keys == ["model/head.bias", "model/head.weight", "model/module.bias", "model/module.weight"]
    plain = Model()
    bcp.load(str(tmp_path / "c"), {"model": plain})
    assert torch.equal(plain.module.weight, saved.module.weight)


def _sharded_metadata() -> CheckpointMetadata:
    """Metadata of a TP 2 x PP 2 x DP 2 layout (planned and built as a save would, no processes),
    through an encode and decode: many boxes per tensor, in 1 and 2 dimensions."""
    from bytecheckpoint.planning.global_plan import plan_save
    from bytecheckpoint.planning.save_metadata import build_metadata, metadata_template
    from bytecheckpoint.planning.simulate import Layout, ModelSpec, local_plans, synthetic_writes

    spec = ModelSpec(layers=2, hidden=64, ffn=96, vocab=130, kv_heads=2, head_dim=16)
    layout = Layout(tp=2, pp=2, dp=2)
    plan = plan_save(local_plans(spec, layout))
    writes = synthetic_writes(plan, layout, chunk_bytes=4096)
    meta = build_metadata(metadata_template(plan, writes), writes, framework="megatron",
                          world_size=layout.world, layout={}, step=1, user_metadata={}, chunk_bytes=4096)
    return CheckpointMetadata.from_bytes(meta.to_bytes())


_SHARDED = _sharded_metadata()


def _boxes_row_by_row(meta: CheckpointMetadata, key: str) -> list:
    """The saved boxes of ``key`` read one table row at a time (what ``boxes_of`` must equal)."""
    from bytecheckpoint.format.boxes import Box
    from bytecheckpoint.format.checksums import chunk_count
    from bytecheckpoint.format.metadata import ByteMeta, SavedBox

    i = [t.key for t in meta.tensors].index(key)
    b, nd = meta.boxes, len(meta.tensors[i].shape)
    out = []
    for r in np.flatnonzero(b.tensor == i):
        s, c = int(b.dim_start[r]), int(b.checksum_start[r])
        n = chunk_count(int(b.byte_length[r]), meta.chunk_bytes)
        ints = (lambda a: tuple(int(x) for x in a))
        box = Box(ints(b.offsets[s:s + nd]), ints(b.lengths[s:s + nd]))
        where = ByteMeta(meta.files[int(b.file[r])].name, int(b.byte_offset[r]), int(b.byte_length[r]),
                         ints(b.checksums[c:c + n]))
        out.append(SavedBox(key, box, where))
    return out


def test_boxes_of_equals_the_table_read_row_by_row():
    meta = _SHARDED
    assert max(len(meta.boxes_of(t.key)) for t in meta.tensors) >= 4
    for t in meta.tensors:
        assert meta.boxes_of(t.key) == _boxes_row_by_row(meta, t.key), t.key
    assert meta.boxes_of("no/such/key") == []


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_boxes_of_touching_keeps_exactly_the_boxes_that_overlap(data):
    from bytecheckpoint.format.boxes import Box, overlaps

    meta = _SHARDED
    t = data.draw(st.sampled_from(meta.tensors))
    wanted = []
    for _ in range(data.draw(st.integers(0, 3))):
        offsets = tuple(data.draw(st.integers(0, s - 1)) for s in t.shape)
        wanted.append(Box(offsets, tuple(data.draw(st.integers(0, s - o)) for s, o in zip(t.shape, offsets))))
    every = meta.boxes_of(t.key)
    expected = [sb for sb in every if any(
        (r := sb.box.intersect(w_)) is not None and not r.is_empty() for w_ in wanted)]
    assert meta.boxes_of(t.key, touching=wanted) == expected
    for sb in every:
        for w_ in wanted:
            assert overlaps(sb.box.offsets, sb.box.lengths, w_) == (sb.box.intersect(w_) is not None)
