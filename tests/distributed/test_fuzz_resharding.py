"""Fuzzing load-time resharding over real process groups: save in one layout, load bit for bit
into any other.

Hypothesis draws cases as plain data in this process (tensors of random shapes, dims of size
0 and 1, 0-d, sizes the mesh does not divide; float32 / bfloat16 / float16 / float64 / int64 /
int8 / bool / uint8 / complex64 filled with random bytes, so NaN payloads, inf, -0.0 and
subnormals; save and load layouts: DTensors on 1-D and 2-D meshes with random Shard /
Replicate placements, hand-described TensorShard boxes with replicas, FSDP-style flat
irregular shards of whole tensors or of TP boxes, plain replicated tensors, random sub-boxes
and flat ranges as load targets; optimizer-like nested dicts along) and one pool of 4 ranks
runs each: saved on the first 1-4 ranks, loaded on the first 1-4 (groups of the pool), and
into plain tensors in this process with no process group. Every local piece is compared bit
for bit with the reference's slice; an error must be a ``CheckpointError`` (the workers
re-raise anything else, failing the case). 200 cases by default (about 20 s on two cores);
``BCP_FUZZ_PROFILE=long`` runs 5,000.
"""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.strategies import fuzz_settings
from tests.support import reshard_fuzz_workloads as w
from tests.support.dist import WorldPool

pytestmark = pytest.mark.fuzz

WORLD = 4


@st.composite
def shapes(draw) -> tuple[int, ...]:
    # (hypothesis favours the first element: not 0-d, not empty)
    ndim = draw(st.sampled_from([2, 1, 3, 0, 2, 1, 3, 2]))
    # mostly sizes the meshes do not divide; a few 1s and 0s (an empty tensor)
    return tuple(draw(st.sampled_from([3, 5, 1, 2, 4, 6, 7, 9, 13, 0, 1, 67])) for _ in range(ndim))


def _cuts(draw, size: int, pieces: int) -> list[int]:
    inner = sorted(draw(st.lists(st.integers(0, size), min_size=pieces - 1, max_size=pieces - 1)))
    return [0, *inner, size]


@st.composite
def dtensor_layout(draw, shape: tuple[int, ...], world: int) -> tuple:
    if draw(st.booleans()) or world < 2:
        mesh_shape: tuple[int, ...] = (draw(st.integers(1, world)),)
    else:
        a = draw(st.integers(1, world // 2 if world >= 2 else 1))
        mesh_shape = (a, draw(st.integers(1, world // a)))
    place = st.just(("R",)) if not shape else st.one_of(
        st.integers(0, len(shape) - 1).map(lambda d: ("S", d)), st.just(("R",)))
    return ("dtensor", mesh_shape, tuple(draw(place) for _ in mesh_shape))


@st.composite
def box_layout(draw, shape: tuple[int, ...], world: int, partition: bool) -> tuple:
    """A partition of the tensor into a grid of boxes over up to 2 dims (some replicated on
    a second rank), or, for loads, each rank a random sub-box."""
    per_rank: list[list] = [[] for _ in range(world)]
    if not partition:
        for r in range(world):
            for _ in range(draw(st.integers(0, 2))):
                offset, lengths = [], []
                for size in shape:
                    lo = draw(st.integers(0, size))
                    offset.append(lo)
                    lengths.append(draw(st.integers(0, size - lo)))
                per_rank[r].append((tuple(offset), tuple(lengths), 0))
        if not any(per_rank):  # some rank must want it: a strict load refuses a key nobody takes
            per_rank[0].append(((0,) * len(shape), shape, 0))
        return ("boxes", per_rank)
    dims = draw(st.lists(st.integers(0, len(shape) - 1), max_size=2, unique=True)) if shape else []
    ranges = [[(0, s)] for s in shape]
    for d in dims:
        cuts = _cuts(draw, shape[d], draw(st.integers(1, 3)))
        ranges[d] = list(zip(cuts, cuts[1:]))
    for cell in itertools.product(*ranges):
        owner = draw(st.integers(0, world - 1))
        box = (tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
        per_rank[owner].append((*box, 0))
        if world > 1 and draw(st.integers(0, 3)) == 0:
            other = (owner + draw(st.integers(1, world - 1))) % world
            per_rank[other].append((*box, 1))
    return ("boxes", per_rank)


@st.composite
def flat_layout(draw, shape: tuple[int, ...], world: int, partition: bool) -> tuple:
    """Flat ranges of the whole tensor, or of dim-0 (TP) boxes of it, cut at random points
    (empty ranges included); for loads, each rank random ranges."""
    per_rank: list[list] = [[] for _ in range(world)]
    boxes = [((0,) * len(shape), shape)]
    if shape and draw(st.booleans()):
        cuts = _cuts(draw, shape[0], draw(st.integers(1, 3)))
        boxes = [((a, *(0,) * (len(shape) - 1)), (b - a, *shape[1:])) for a, b in zip(cuts, cuts[1:])]
    for offset, lengths in boxes:
        n = math.prod(lengths)
        if partition:
            cuts = _cuts(draw, n, draw(st.integers(1, world + 1)))
            for a, b in zip(cuts, cuts[1:]):
                per_rank[draw(st.integers(0, world - 1))].append((offset, lengths, a, b))
        else:
            for r in range(world):
                if draw(st.booleans()):
                    a = draw(st.integers(0, n))
                    per_rank[r].append((offset, lengths, a, draw(st.integers(a, n))))
    if not any(per_rank):  # some rank must want it: a strict load refuses a key nobody takes
        per_rank[0].append(boxes[0] + (0, math.prod(boxes[0][1])))
    return ("flat", per_rank)


def layout(shape: tuple[int, ...], world: int, partition: bool) -> st.SearchStrategy:
    plain = st.just(("replicated",)) if partition else st.sampled_from([("replicated",), ("strided",)])
    return st.one_of(dtensor_layout(shape, world), plain,
                     box_layout(shape, world, partition), flat_layout(shape, world, partition))


@st.composite
def cases(draw) -> dict:
    save_world = draw(st.integers(1, WORLD))
    load_worlds = draw(st.lists(st.integers(1, WORLD), min_size=1, max_size=3))
    tensors = []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(shapes())
        tensors.append({
            "name": f"t{i}", "shape": shape, "dtype": draw(st.sampled_from(sorted(w.DTYPES))),
            "save": draw(layout(shape, save_world, partition=True)),
            "loads": [draw(layout(shape, n, partition=False)) for n in load_worlds],
        })
    return {"seed": draw(st.integers(0, 2**31)), "save_world": save_world,
            "loads": [{"world": n, "verify": draw(st.booleans())} for n in load_worlds], "tensors": tensors,
            "optim": draw(st.booleans()), "modules": draw(st.booleans())}


def check(pool, path: str, case: dict) -> None:
    results = pool.run(w.run_case, path, case)
    for rank, r in enumerate(results):
        assert r["save"] is None, (rank, r["save"], case)
        for i, got in enumerate(r["loads"]):
            assert not got, (rank, i, case["loads"][i], got, case)
    assert w.load_in_process(path, case) == [], case


@pytest.fixture(scope="module")
def fuzz_pool():
    """A pool of this module's own: saves on subsets of the ranks create process groups on
    those ranks alone, which leaves the ranks' counts of groups apart, and a later test that
    creates a locally synchronised group of its own on a shared pool would then name it
    differently on its ranks (torch names such a group by that count) and wait for ever."""
    pool = WorldPool(WORLD)
    yield pool
    pool.close()


@fuzz_settings(200)  # BCP_FUZZ_PROFILE=long: 5,000
@given(cases())
def test_any_layout_loads_bit_for_bit_into_any_other(fuzz_pool, tmp_path_factory, case):
    check(fuzz_pool, str(tmp_path_factory.mktemp("fuzz") / "c"), case)


# -- what the fuzzer found ---------------------------------------------------------------------------


def _zero_d(save: list, load: tuple) -> dict:
    return {"seed": 7, "save_world": 2, "loads": [{"world": 2}], "optim": True,
            "tensors": [{"name": "t", "shape": (), "dtype": "float16", "save": ("flat", save),
                         "loads": [load]}]}


@pytest.mark.parametrize("holder", [0, 1])
def test_a_0d_tensor_that_one_rank_holds_none_of(fuzz_pool, tmp_path, holder):
    # Was: the rank with an empty flat range of a 0-d tensor offered Box((), ()), its one
    # element, as "nothing"; picked as its writer it raised a bare RuntimeError ("this rank
    # holds no box containing ...") and the other ranks waited in a collective for ever.
    save = [[((), (), 0, 0)], [((), (), 0, 0)]]
    save[holder] = [((), (), 0, 1)]
    for load in [("replicated",), ("flat", save)]:
        check(fuzz_pool, str(tmp_path / f"{len(load)}" / "c"), _zero_d(save, load))


def test_saves_on_overlapping_subgroups(fuzz_pool, tmp_path):
    # Was: a save on ranks [1, 2] made its own group on those two ranks only, so a later save
    # on [1, 2, 3] named its new group differently on rank 3 (torch names a locally
    # synchronised group by the count of groups a process has) and all three waited for ever.
    assert fuzz_pool.run(w.overlapping_subgroup_saves, str(tmp_path)) == [[]] * WORLD
