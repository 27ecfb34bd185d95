"""The replica check's samples are the values of ``save()`` time: digested later, in the
write, they must not follow the live tensor (a small replica was sampled as an alias)."""

from __future__ import annotations

import pytest
import torch

from bytecheckpoint.engine import replicas
from bytecheckpoint.errors import InvalidArgumentError


@pytest.mark.parametrize("numel", [1, 64, 100, 10_000])
def test_samples_are_copies_of_save_time(numel):
    live = torch.arange(float(numel))
    rows = [(0, (0,))]
    before = replicas.replica_digests(replicas.take_samples([live.clone()], rows))
    samples = replicas.take_samples([live], rows)
    live.mul_(-1).sub_(1)  # changes every element, the sampled ones included
    assert replicas.replica_digests(samples) == before
    assert replicas.replica_digests(replicas.take_samples([live], rows)) != before


def test_the_setting_is_read_and_checked(monkeypatch):
    monkeypatch.setenv(replicas.MODE_ENV, "off")
    assert replicas.take_samples([torch.ones(3)], [(0, (0,))]) is None
    monkeypatch.setenv(replicas.MODE_ENV, "Warn ")
    assert replicas.mode() == "warn"
    monkeypatch.setenv(replicas.MODE_ENV, "sometimes")
    with pytest.raises(InvalidArgumentError, match="BCP_DIFFERING_REPLICAS='sometimes'"):
        replicas.take_samples([torch.ones(3)], [(0, (0,))])


def _digests(views):
    return replicas.replica_digests(replicas.take_samples(views, [(i, (i,)) for i in range(len(views))]))


def test_the_same_values_in_another_layout_or_a_lazy_view_digest_alike():
    torch.manual_seed(3)
    wide = torch.randn(96, 70)
    plain = [wide, wide[:, :1].clone(), torch.randn(5, 3, dtype=torch.complex64).conj().resolve_conj(),
             torch.arange(7.0).neg(), torch.tensor(2.5)]
    other = [wide.t().contiguous().t(), wide[:, :1],  # transposed memory; a strided column
             plain[2].conj().resolve_conj().conj(), torch.arange(7.0)._neg_view(), torch.tensor([2.5])[0]]
    assert not other[0].is_contiguous() and other[2].is_conj() and other[3].is_neg()
    assert _digests(other) == _digests(plain)


@pytest.mark.parametrize("changed", [0, 137, 199])
def test_one_step_counter_of_many_that_differs_is_seen(changed):
    counters = [torch.tensor(float(i)) for i in range(200)] + [torch.zeros(3, dtype=torch.int64)]
    rows = [(0, tuple(range(201)))]  # one replica set of 201 boxes
    before = replicas.replica_digests(replicas.take_samples(counters, rows))
    counters[changed] = counters[changed] + 1
    assert replicas.replica_digests(replicas.take_samples(counters, rows)) != before
