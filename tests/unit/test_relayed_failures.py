"""A rank's failure is summed up once: a load whose planning failed with an error of no named
kind said "rank 0: RankFailedError: ... rank 0: <the error>", the summary wrapped in itself
(the first collective that learns of a failure sums it up, the last one summed it up again)."""

from __future__ import annotations

import pytest
import torch

import bytecheckpoint as bcp
import bytecheckpoint.engine.load as load_engine
from bytecheckpoint.errors import RankFailedError


def test_an_unnamed_planning_error_is_summed_up_once(tmp_path, monkeypatch):
    path = str(tmp_path / "step_1")
    bcp.save(path, {"w": torch.ones(4)}, step=1)

    def unreadable(*_args, **_kwargs):
        raise ZeroDivisionError("a failure of no named kind")

    monkeypatch.setattr(load_engine, "read_metadata_identified", unreadable)
    with pytest.raises(RankFailedError) as caught:
        bcp.load(path, {"w": torch.zeros(4)})
    message = str(caught.value)
    assert "rank 0: ZeroDivisionError: a failure of no named kind" in message
    assert message.count("failed on") == 1 and "RankFailedError" not in message
