"""Small leftovers of the reviews of 2026-11-28: each gave a misleading error, a silent default
or a raw one where the right answer or a named error was due."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli
from bytecheckpoint.errors import (
    InvalidSettingError,
    MissingKeysError,
    StateMismatchError,
    UnsupportedStateError,
)
from bytecheckpoint.format.metadata import FORMAT_VERSION, METADATA_FILE, pack_document, unpack_document
from bytecheckpoint.storage import faults


def _model_state(value: float = 1.0) -> dict[str, Any]:
    return {"model": {"w": torch.full((8,), value)}}


def _loader(tmp_path: Any) -> Any:
    from bytecheckpoint.data import TokenLoader, synthetic_sources

    sources = synthetic_sources(str(tmp_path / "src"), [40], vocab=50, min_len=1, max_len=12, seed=1)
    return lambda: TokenLoader(sources, context=7, batch_size=2, workers=1, dp_rank=0, dp_size=1)


# -- 1. a data loader or RNG state the checkpoint lacks is a missing key -------------------------

def test_a_missing_loader_or_rng_entry_is_a_missing_key(tmp_path):
    # Was: StateMismatchError "the checkpoint holds no state for this data loader" / "no RNG
    # state", even with strict=False, which loads what the state and checkpoint share.
    url = f"{tmp_path}/ck"
    bcp.save(url, _model_state(2.0), step=1)
    make = _loader(tmp_path)
    loader = make()
    try:
        for key, obj in (("loader", loader), ("rng", bcp.RNGState())):
            target = _model_state(0.0)
            target[key] = obj
            result = bcp.load(url, target, strict=False)
            assert result.missing_keys == [key]
            assert torch.equal(target["model"]["w"], torch.full((8,), 2.0))
            with pytest.raises(MissingKeysError, match=f"missing from the checkpoint: {key}"):
                bcp.load(url, target)
        assert loader.batches == 0 and next(loader).tokens.numel() > 0  # left as it was
    finally:
        loader.close()


# -- 2. a loader only restored may be restored again ---------------------------------------------

def test_a_restored_loader_takes_another_checkpoint_and_an_iterated_one_says_so(tmp_path):
    # Was: "load the data loader's state before iterating it" for a loader restored (not
    # iterated) that a retry of an older step loaded into again.
    make = _loader(tmp_path)
    saver = make()
    try:
        for step in (1, 2, 3):
            next(saver)
            bcp.save(f"{tmp_path}/ck{step}", {"loader": saver}, step=step)
    finally:
        saver.close()
    fresh = make()
    bcp.load(f"{tmp_path}/ck1", {"loader": fresh})
    want = next(fresh).tokens
    fresh.close()
    again = make()
    try:
        bcp.load(f"{tmp_path}/ck3", {"loader": again})
        bcp.load(f"{tmp_path}/ck1", {"loader": again})
        assert again.batches == 1 and torch.equal(next(again).tokens, want)
        with pytest.raises(StateMismatchError, match="already iterated .* into a new TokenLoader"):
            bcp.load(f"{tmp_path}/ck1", {"loader": again})
    finally:
        again.close()


# -- 3. bad commit settings are named as a save starts -------------------------------------------

@pytest.mark.parametrize("name,value", [
    ("BCP_SAVE_LEASE_S", "abc"), ("BCP_SAVE_LEASE_S", "-1"), ("BCP_SAVE_LEASE_S", "inf"),
    ("BCP_SAVE_HEARTBEAT_S", "nan"), ("BCP_SAVE_HEARTBEAT_S", "400"),  # not under the 300 s lease
    ("BCP_SAVE_STAGING_GRACE_S", "-5"), ("BCP_OVERWRITE_WAIT_S", "inf"),
    ("BCP_STORAGE_SLOTS_DIR", "missing"), ("BCP_STORAGE_SLOTS_DIR", "a-file"),
])
def test_a_bad_commit_setting_is_named_not_defaulted(tmp_path, monkeypatch, name, value):
    # Was: each fell back to its default without a word (a slots directory that is no
    # directory turned the host's write limit off).
    (tmp_path / "a-file").write_text("")
    if name == "BCP_STORAGE_SLOTS_DIR":
        value = str(tmp_path / value)
    monkeypatch.setenv(name, value)
    with pytest.raises(InvalidSettingError, match=name):
        bcp.save(f"{tmp_path}/ck", _model_state(), step=1)
    assert not os.path.exists(f"{tmp_path}/ck")
    monkeypatch.delenv(name)
    for name, value in (("BCP_OVERWRITE_WAIT_S", "0"), ("BCP_SAVE_STAGING_GRACE_S", "0"),
                        ("BCP_SAVE_LEASE_S", "40"), ("BCP_STORAGE_SLOTS_DIR", str(tmp_path))):
        monkeypatch.setenv(name, value)
    bcp.save(f"{tmp_path}/ck", _model_state(), step=1)


# -- 4. bcp ls: a newer format's checkpoint is committed, in a format this release cannot read -----

def test_ls_shows_a_newer_format_as_committed_and_gc_keeps_it(tmp_path, capsys):
    # Was: "COMMITTED no, TIER uncommitted", as if a save had crashed there.
    run = tmp_path / "run"
    for step in (1, 2, 3):
        bcp.save(f"{run}/step_{step}", _model_state(step), step=step)
    meta = run / "step_3" / METADATA_FILE
    doc = unpack_document(meta.read_bytes())
    doc["version"] = FORMAT_VERSION + 1
    meta.write_bytes(pack_document(doc))
    capsys.readouterr()
    assert cli.main(["ls", "--json", str(run)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["checkpoints"]}
    newer = rows["step_3"]
    assert newer["committed"] is True and newer["newer_format"] is True
    assert newer["tier"] == "newer-format" and "upgrade bytecheckpoint" in newer["problem"]
    assert cli.main(["ls", str(run)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("step_3"))
    assert " yes " in line and "newer-format" in line and "uncommitted" not in line
    assert cli.main(["gc", str(run), "--keep-last", "1", "--yes", "-q"]) == 0
    assert sorted(os.listdir(run)) == ["latest", "step_2", "step_3"]


# -- 5. bcp verify: a failed read of a data piece is the storage's, not the file's ---------------

@pytest.mark.parametrize("code", ["EMFILE", "EIO"])
def test_verify_calls_a_failed_piece_read_a_storage_error(tmp_path, capsys, code):
    # Was: exit 1, "BAD ... cannot read bytes ...: Too many open files", an intact file called bad.
    url = f"{tmp_path}/ck"
    bcp.save(url, _model_state(), step=1)
    reads = 0
    for n in range(1, 8):  # the first reads are the header's: fail each read in turn
        faults.install(f"errno={code};ops=read_into;path=.safetensors;fail_call={n}")
        try:
            code_out = cli.main(["verify", url])
        finally:
            faults.install(None)
        out = capsys.readouterr()
        if code_out == 0:
            break
        reads += 1
        assert code_out == 6 and code in out.err and "BAD" not in out.out, (n, out)
    assert reads >= 2  # the header's read and a piece's
    assert cli.main(["verify", url]) == 0


# -- 6. a plain value nested deeper than Python recurses -----------------------------------------

def test_a_deeply_nested_value_is_a_named_error_and_loads_into_none(tmp_path):
    # Was: RankFailedError wrapping RecursionError.
    def nest(n: int, leaf: int) -> Any:
        value: Any = leaf
        for _ in range(n):
            value = [value]
        return value

    url = f"{tmp_path}/ck"
    bcp.save(url, {"cfg": nest(900, 1)}, step=1)
    with pytest.raises(UnsupportedStateError, match=r"state\['cfg'\] nests too deeply .* pass None"):
        bcp.load(url, {"cfg": nest(900, 0)})
    target: dict[str, Any] = {"cfg": None}
    bcp.load(url, target)
    assert target["cfg"] == nest(900, 1)
