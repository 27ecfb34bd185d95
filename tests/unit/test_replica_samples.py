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
