"""``overwrite=True`` on an object store (moto S3): the old checkpoint stays committed until the
new metadata replaces it, so a save that fails or dies at any step leaves one of the two
loadable, bit for bit; its leftovers go with the next overwrite. Also: every rank of a load
that meets a swap raises CheckpointReplacedError, and an abort after a failure never hides it.

Run as a module it is the crashing saver:
    python -m tests.integration.test_overwrite_object_store crash MOMENT URL SEED
MOMENT: ``write`` (mid data file), ``put`` (data written, before the metadata PUT), ``swapped``
(after the PUT, before the replaced files are deleted); or
    python -m tests.integration.test_overwrite_object_store loop URL SAVES
overwrites URL with seeds 1, 2, 1, 2 ...
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.commit.integrity import read_metadata
from bytecheckpoint.errors import CheckpointReplacedError, PermanentStorageError
from bytecheckpoint.format.metadata import METADATA_FILE
from bytecheckpoint.storage import faults, open_storage, register_backend
from bytecheckpoint.storage.s3 import S3Storage
from tests.support.helpers import assert_same_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_state(seed: int) -> dict:
    """A small model and optimizer-like state whose every byte depends on ``seed``."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(24, 16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return {"model": model, "extra_state": {"seed": seed, "moments": torch.randn(40, generator=g)}}


def flat(state: dict) -> dict:
    out = {f"model.{k}": v.clone() for k, v in state["model"].state_dict().items()}
    out["seed"] = state["extra_state"]["seed"]
    out["moments"] = state["extra_state"]["moments"].clone()
    return out


def loaded(url: str) -> dict:
    state = make_state(0)
    state["extra_state"] = {}
    bcp.load(url, state)
    return flat(state)


def files_of(url: str) -> tuple[list[str], set[str]]:
    """What the checkpoint's prefix holds, and what its committed metadata names."""
    storage, path = open_storage(url)
    named = {f.name for f in read_metadata(storage, path).files} | {METADATA_FILE}
    return storage.list_dir(path), named


def _s3_root(name: str) -> str:
    from tests.support.servers import s3_root

    return s3_root(name)


# -- 1. a successful overwrite ------------------------------------------------------------------


@pytest.mark.parametrize("files_per", ["rank", "host"])
def test_s3_an_overwrite_replaces_the_checkpoint_and_leaves_none_of_its_files(files_per):
    url = f"{_s3_root('ok')}/ckpt"
    kwargs = {"files_per": files_per, "host_size": 1}
    bcp.save(url, make_state(1), step=1, **kwargs)
    listing, named = files_of(url)
    assert sorted(named - {METADATA_FILE}) == sorted(n for n in listing if n.endswith(".safetensors"))
    assert all(n.count(".") == 1 for n in named - {METADATA_FILE})  # no tag: the names of old
    old_files = set(listing) - {METADATA_FILE}

    for seed in (2, 3):  # over a plain checkpoint, then over a tagged one
        bcp.save(url, make_state(seed), step=seed, overwrite=True, **kwargs)
        assert_same_state(flat(make_state(seed)), loaded(url))
        listing, named = files_of(url)
        assert set(listing) == named, f"left behind: {set(listing) - named}"
        assert not old_files & set(listing)
        old_files = set(listing) - {METADATA_FILE}
    assert bcp.verify(url) == []


# -- 2. a failure at each step leaves the old checkpoint ------------------------------------------


@pytest.mark.parametrize("spec", [
    "ops=open_writer;path=.safetensors",  # the first data file cannot even start
    "ops=write;path=.safetensors",  # mid data file
    "ops=commit;path=.safetensors",  # a data file's completion
    "ops=open_writer,write,commit;path=metadata.msgpack",  # the metadata PUT itself
])
def test_s3_an_overwrite_that_fails_before_its_commit_leaves_the_old_checkpoint(spec):
    url = f"{_s3_root('fail')}/ckpt"
    bcp.save(url, make_state(1), step=1)
    before, _ = files_of(url)
    faults.install(f"{spec};fail_every=1;permanent=1")
    try:
        with pytest.raises(PermanentStorageError, match="injected fault"):
            bcp.save(url, make_state(2), step=2, overwrite=True)
    finally:
        faults.install(None)
    assert_same_state(flat(make_state(1)), loaded(url))
    assert_same_state(flat(make_state(1)), loaded(os.path.dirname(url)))  # through latest
    assert files_of(url)[0] == before  # the failed save removed what it wrote
    bcp.save(url, make_state(3), step=3, overwrite=True)
    assert_same_state(flat(make_state(3)), loaded(url))


def test_s3_a_failed_clean_up_after_the_commit_keeps_the_new_checkpoint_and_the_next_save_finishes_it():
    url = f"{_s3_root('sweep')}/ckpt"
    bcp.save(url, make_state(1), step=1)
    old, _ = files_of(url)
    faults.install("ops=delete;path=.safetensors;fail_every=1;permanent=1")
    try:
        bcp.save(url, make_state(2), step=2, overwrite=True)  # committed: no error for the clean-up
    finally:
        faults.install(None)
    assert_same_state(flat(make_state(2)), loaded(url))
    listing, named = files_of(url)
    assert set(old) - {METADATA_FILE} <= set(listing) - named  # the replaced files are still there
    bcp.save(url, make_state(3), step=3, overwrite=True)
    listing, named = files_of(url)
    assert set(listing) == named
    assert_same_state(flat(make_state(3)), loaded(url))


# -- 3. a crash at each step ------------------------------------------------------------------------


class CrashingS3(S3Storage):
    """S3 whose process dies (SIGKILL) at one moment of an overwrite."""

    scheme = "crashs3"

    def __init__(self, moment: str) -> None:
        super().__init__()
        self.moment = moment
        self.put = False

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def open_writer(self, path: str):
        writer = super().open_writer(path)
        if self.moment == "write" and path.endswith(".safetensors"):
            original = writer.write

            def write(data):
                original(bytes(memoryview(data)[: max(1, len(data) // 2)]))
                writer.commit()  # half a file, in place: what a dying upload can leave
                self._die()

            writer.write = write
        if path.endswith(METADATA_FILE):
            if self.moment == "put":
                self._die()
            original_commit = writer.commit

            def commit():
                size = original_commit()
                self.put = True
                return size

            writer.commit = commit
        return writer

    def delete(self, path: str) -> None:
        if self.moment == "swapped" and self.put and path.endswith(".safetensors"):
            self._die()
        super().delete(path)


def _worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.integration.test_overwrite_object_store", *args],
                            cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("moment, survivor", [("write", 1), ("put", 1), ("swapped", 2)])
def test_s3_a_crash_during_an_overwrite_leaves_the_old_or_the_new_checkpoint(moment, survivor):
    url = f"{_s3_root('crash')}/ckpt"
    bcp.save(url, make_state(1), step=1)
    proc = _worker("crash", moment, "crashs3://" + url[len("s3://"):], "2")
    proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert_same_state(flat(make_state(survivor)), loaded(url))
    listing, named = files_of(url)
    assert set(listing) - named  # the dead save's garbage (or the replaced files) are there
    bcp.save(url, make_state(3), step=3, overwrite=True)  # and the next overwrite removes them
    assert_same_state(flat(make_state(3)), loaded(url))
    listing, named = files_of(url)
    assert set(listing) == named
    storage, path = open_storage(os.path.dirname(url))
    assert sorted(storage.list_dir(path)) == ["ckpt", "latest"]  # no owner record left


# -- 4. a load racing overwrites ---------------------------------------------------------------------


def test_s3_loads_racing_overwrites_get_one_save_bit_exactly_or_checkpoint_replaced():
    url = f"{_s3_root('race')}/ckpt"
    bcp.save(url, make_state(2), step=2)
    refs = {1: flat(make_state(1)), 2: flat(make_state(2))}
    writer = _worker("loop", url, "8")
    outcomes = {"one save": 0, "replaced": 0}
    try:
        while writer.poll() is None:
            try:
                got = loaded(url)
            except CheckpointReplacedError as exc:
                assert "load again" in str(exc)
                outcomes["replaced"] += 1
                continue
            assert_same_state(refs[got["seed"]], got)  # never a mixture of two saves
            outcomes["one save"] += 1
    finally:
        out, _ = writer.communicate(timeout=120)
    assert json.loads(out.strip().splitlines()[-1]) == {"ok": True, "saves": 8}
    assert outcomes["one save"] > 0, outcomes


# -- 5. every rank of a load raises CheckpointReplacedError ----------------------------------------


def swap_seen_by_one_rank(root: str) -> str:
    """Rank 1 notices the swap when the load checks the metadata at its end; rank 0 had checked
    (unchanged) just before. Returns the name of the error this rank raised."""
    import torch.distributed as dist

    from bytecheckpoint.engine import load as load_module

    rank = dist.get_rank()
    path, other = f"{root}/ckpt", f"{root}/other"
    bcp.save(path, make_state(1), step=1)
    bcp.save(other, make_state(2), step=2)
    checked = f"{root}/rank0-checked"
    original = load_module.metadata_identity

    def identity(storage, where):
        if rank == 1:
            deadline = time.time() + 60
            while not os.path.exists(checked) and time.time() < deadline:
                time.sleep(0.01)
            # Another save replaces the metadata now (the data files would go next).
            with open(f"{other}/{METADATA_FILE}", "rb") as src, open(f"{path}/{METADATA_FILE}", "wb") as dst:
                dst.write(src.read())
            return original(storage, where)
        value = original(storage, where)
        open(checked, "w").close()
        return value

    load_module.metadata_identity = identity
    try:
        bcp.load(path, make_state(0), verify=False)
    except Exception as exc:  # what the user sees on this rank
        return f"{type(exc).__name__}: {exc}"
    finally:
        load_module.metadata_identity = original
    return "no error"


def test_every_rank_raises_checkpoint_replaced_when_one_rank_detects_the_swap(world, tmp_path):
    got = world(2).run(swap_seen_by_one_rank, str(tmp_path))
    assert all(g.startswith("CheckpointReplacedError") for g in got), got
    assert "load again" in got[0] and "rank 1" in got[0]


# -- 6. an abort that fails after a failure --------------------------------------------------------


def test_a_failing_abort_does_not_hide_the_write_failure(tmp_path):
    url = str(tmp_path / "ckpt")
    faults.install("ops=write,abort;path=.safetensors;fail_every=1;permanent=1")
    try:
        with pytest.raises(PermanentStorageError, match="on write") as info:
            bcp.save(url, make_state(1), step=1)
    finally:
        faults.install(None)
    assert "on abort" not in str(info.value)
    bcp.save(url, make_state(2), step=2)
    assert_same_state(flat(make_state(2)), loaded(url))


def cached_save_with_a_failing_clean_up(root: str) -> str:
    """A save under a cached plan where rank 1's write fails and the coordinator cannot delete
    the staging directory afterwards. Returns the error this rank raised."""
    import torch.distributed as dist

    state = make_state(1)
    bcp.save(f"{root}/first", state, step=1)  # plans: the next save of this structure hits the cache
    rank = dist.get_rank()
    faults.install("ops=delete;path=.staging-;fail_every=1;permanent=1" if rank == 0 else
                   "ops=open_writer,write;path=.safetensors;fail_every=1;permanent=1")
    try:
        bcp.save(f"{root}/second", state, step=2)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        faults.install(None)
    return "no error"


def test_a_failed_clean_up_after_a_rank_failed_does_not_hide_its_error(world, tmp_path):
    got = world(2).run(cached_save_with_a_failing_clean_up, str(tmp_path))
    assert all("permission denied on open_writer" in g or "permission denied on write" in g for g in got), got
    assert not any("on delete" in g for g in got), got
    bcp.save(str(tmp_path / "second"), make_state(2), step=2)  # the path takes the next save
    assert_same_state(flat(make_state(2)), loaded(str(tmp_path / "second")))


def test_a_failing_abort_does_not_hide_a_failed_cold_copy(tmp_path):
    from storage_tiering import load_config, run_once

    hot, cold = str(tmp_path / "ssd"), str(tmp_path / "hdd")
    os.makedirs(cold)
    for step in (1, 2):
        bcp.save(f"{hot}/run/step_{step}", make_state(step), step=step)
    old = time.time() - 30 * 86400
    for n in os.listdir(f"{hot}/run/step_1"):
        os.utime(f"{hot}/run/step_1/{n}", (old, old))
    faults.install(f"ops=write,abort;path={cold}/run/step_1/;fail_every=1;permanent=1")
    try:
        report = run_once(load_config(hot=hot, cold=cold, cool_after="1d", keep_newest=1))
    finally:
        faults.install(None)
    why = report.failed[f"{hot}/run/step_1"]
    assert "on write" in why and "on abort" not in why, why
    assert_same_state(flat(make_state(1)), loaded(f"{hot}/run/step_1"))


# -- the subprocess savers -----------------------------------------------------------------------------


def main() -> None:
    torch.set_num_threads(1)
    mode = sys.argv[1]
    result: dict = {"ok": True}
    if mode == "crash":
        moment, url, seed = sys.argv[2], sys.argv[3], int(sys.argv[4])
        register_backend("crashs3", lambda: CrashingS3(moment))
        bcp.save(url, make_state(seed), step=seed, overwrite=True)
    elif mode == "loop":
        url, saves = sys.argv[2], int(sys.argv[3])
        states = [make_state(1), make_state(2)]
        for n in range(saves):
            bcp.save(url, states[n % 2], step=n + 3, overwrite=True)
        result["saves"] = saves
    print(json.dumps(result))


if __name__ == "__main__":
    main()
