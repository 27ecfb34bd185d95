"""A rank's dp / tp / pp from its coordinate in a named device mesh (runtime/identity.py)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bytecheckpoint.runtime.identity import AXIS_NAMES, axes_of


def test_each_named_dimension_gives_its_axis():
    assert axes_of(("dp", "tp"), (1, 3), (2, 4)) == {"dp": 1, "tp": 3}
    assert axes_of(("PP", "Data", "Tensor"), (2, 0, 1), (4, 2, 2)) == {"pp": 2, "dp": 0, "tp": 1}


def test_several_data_parallel_dimensions_make_one_dp_index_row_major():
    # torchtitan's names: the replicate and shard groups of HSDP, context parallel left out
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert axes_of(names, (1, 1, 2, 0, 3), (2, 2, 4, 2, 4)) == {"pp": 1, "dp": 1 * 4 + 2, "tp": 3}


def test_dimensions_of_other_names_give_nothing():
    assert axes_of(("cp", "ep"), (1, 1), (2, 2)) == {}
    assert axes_of((), (), ()) == {}


@given(st.lists(st.tuples(st.sampled_from(sorted(AXIS_NAMES["dp"])), st.integers(1, 6)),
                min_size=1, max_size=4, unique_by=lambda d: d[0]), st.data())
def test_dp_indices_of_a_mesh_are_each_rank_s_own(dims, data):
    """Every coordinate of the data-parallel dimensions gets a different dp, 0 .. size-1."""
    names = [n for n, _ in dims]
    sizes = [s for _, s in dims]
    coordinate = [data.draw(st.integers(0, s - 1)) for s in sizes]
    total = 1
    for s in sizes:
        total *= s
    dp = axes_of(names, coordinate, sizes)["dp"]
    assert 0 <= dp < total
    # the index decodes back to the coordinate (row-major)
    back = []
    for s in reversed(sizes):
        back.append(dp % s)
        dp //= s
    assert back[::-1] == coordinate


def test_a_state_s_tensors_are_found_without_flattening_it():
    """Modules, optimizers and nested containers give their tensors, each once, lazily; a
    state that holds itself does not loop."""
    import torch

    from bytecheckpoint.runtime.identity import state_tensors

    model = torch.nn.Linear(2, 3)
    model.register_buffer("scale", torch.ones(1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    loose = torch.zeros(4)
    state: dict = {"model": model, "optim": optim, "extra": [{"t": loose}, (loose, 3, "x")]}
    state["self"] = state
    found = list(state_tensors(state))
    assert [id(t) for t in found] == [id(model.weight), id(model.bias), id(model.scale),
                                      id(model.weight), id(model.bias), id(loose)]
    # lazy: a walk stopped at the first tensor never reaches the rest
    walk = state_tensors({"a": model, "b": object()})
    assert next(walk) is model.weight
    assert list(state_tensors({"n": 1, "s": "text"})) == []
