"""The one protection rule (bytecheckpoint.manage.protection), table-driven, and the one way
retention applies it: the manager, ``bcp gc`` and the tiering service decide on the same
checkpoints the same way (abandoned ones are kept and not counted; protected ones are never
deleted; counting is per run)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bytecheckpoint.cli.gc import plan_gc
from bytecheckpoint.errors import InvalidArgumentError
from bytecheckpoint.manage.protection import counted, protected_reason, untouchable_reason
from bytecheckpoint.manage.records import CheckpointInfo
from bytecheckpoint.manage.retention import Context, KeepLast, plan_deletions
from storage_tiering.config import TieringConfig
from storage_tiering.plan import decide

DAY = 86400.0
NOW = 1_000 * DAY


def ckpt(step: int, run: str = "run", **kw) -> CheckpointInfo:
    base = CheckpointInfo(step=step, name=f"step_{step}", url=f"/r/{run}/step_{step}", time=NOW - 100 * DAY,
                          size=10, tier="hot", run=run, path=f"/r/{run}/step_{step}",
                          modified=NOW - 100 * DAY, files=("model-00000.safetensors", "metadata.msgpack"))
    return replace(base, **kw)


# (fields, untouchable reason, protected reason, counted by retention)
TABLE = [
    ({}, None, None, True),
    ({"latest": True}, "named by latest", "named by latest", True),
    ({"pinned": True}, "pinned", "pinned", True),
    ({"being_read": True}, "being read (lease)", "being read (lease)", True),
    ({"staging": True}, "a save to this path is under way", "a save to this path is under way", True),
    ({"committed": False}, "uncommitted", "uncommitted", False),
    ({"committed": False, "staging": True}, "a save is being written", "a save is being written", False),
    ({"problem": "odd step"}, "cannot be classified: odd step", "cannot be classified: odd step", False),
    ({"abandoned": True}, None, "abandoned by a rollback (kept until deleted by hand)", False),
    ({"abandoned": True, "pinned": True}, "pinned", "pinned", False),
    ({"problem": "bad latest", "latest": True}, "cannot be classified: bad latest",
     "cannot be classified: bad latest", False),
]


@pytest.mark.parametrize("fields,untouchable,protected,is_counted", TABLE, ids=lambda v: str(v)[:40])
def test_the_protection_rule(fields, untouchable, protected, is_counted):
    c = ckpt(5, **fields)
    assert untouchable_reason(c) == untouchable
    assert protected_reason(c) == protected
    assert counted(c) is is_counted


@pytest.mark.parametrize("fields,untouchable,protected,is_counted", TABLE, ids=lambda v: str(v)[:40])
def test_manager_gc_and_tiering_agree_on_a_protected_checkpoint(fields, untouchable, protected, is_counted):
    """Step 1 carries the flags, steps 2 and 3 are plain: every tool keeps step 1 exactly when
    the rule protects it, and says why in the rule's words."""
    cs = [ckpt(1, **fields), ckpt(2), ckpt(3)]
    manager = plan_deletions(cs, KeepLast(1), context=Context(now=NOW))
    gc = plan_gc(cs, keep_last=1, keep_every=0)
    tier = decide(cs, TieringConfig(hot="/r", cold="/c", cool_after=DAY, delete_after=2 * DAY, keep_newest=1),
                  now=NOW)
    assert manager[0].delete is gc[0].delete is (protected is None)
    assert (tier[0].action == "delete") is (protected is None)
    if protected is not None:
        assert manager[0].reason == gc[0].reason == protected
        # Cooling is refused only for an untouchable one (an abandoned one may be cooled).
        assert tier[0].reason == (untouchable or "older than cool_after")
    assert [d.delete for d in manager[1:]] == [d.delete for d in gc[1:]] == [True, False]


def test_abandoned_checkpoints_are_not_counted_among_the_newest():
    cs = [ckpt(1), ckpt(2), ckpt(3, abandoned=True), ckpt(4, abandoned=True)]
    got = plan_gc(cs, keep_last=2, keep_every=0)
    assert [d.delete for d in got] == [False, False, False, False]
    assert got[1].reason == "among the newest 2 of its run" and got[3].reason.startswith("abandoned")
    # The tiering service may cool an abandoned checkpoint (it stays loadable), never delete it.
    tier = decide(cs, TieringConfig(hot="/r", cold="/c", cool_after=DAY, delete_after=2 * DAY, keep_newest=2),
                  now=NOW)
    assert [d.action for d in tier] == ["keep", "keep", "cool", "cool"]


def test_counting_is_per_run():
    cs = [ckpt(1, run="a"), ckpt(2, run="a"), ckpt(1, run="b"), ckpt(7, run="b")]
    assert [d.delete for d in plan_deletions(cs, KeepLast(1), context=Context(now=NOW))] == \
        [True, False, True, False]
    assert [d.action for d in decide(cs, TieringConfig(hot="/r", cold="/c", cool_after=DAY, keep_newest=1),
                                     now=NOW)] == ["cool", "keep", "cool", "keep"]


def test_a_policy_that_keeps_nothing_is_refused_for_retention():
    from bytecheckpoint.manage.retention import KeepNone

    with pytest.raises(InvalidArgumentError, match="keeps none"):
        plan_deletions([ckpt(1), ckpt(2)], KeepNone(), context=Context(now=NOW))


def test_cooling_uses_the_age_of_the_files_not_the_save_time():
    young = ckpt(1, modified=NOW - 60.0)  # saved long ago, its files touched a minute ago
    old = ckpt(2)
    got = decide([young, old, ckpt(3, latest=True)],
                 TieringConfig(hot="/r", cold="/c", cool_after=DAY, keep_newest=0), now=NOW)
    assert [d.action for d in got] == ["keep", "cool", "keep"]
    assert got[0].reason == "younger than cool_after"
