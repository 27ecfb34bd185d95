"""A checkpoint of modules (or a DCP directory) loads into a plain state dict as well, DCP's
idiom ``load({"model": model.state_dict()})``: its tensors are filled in place and resharded,
so the model they alias is loaded. The functions without ``test_`` run on every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import bytecheckpoint as bcp
from tests.support.helpers import same_bits
from tests.support.workloads import full_state, make_fsdp2, make_plain, train_step


def _model_bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in full_state(model, torch.optim.SGD(model.parameters(), lr=0.1)).items()
            if k.startswith("model/")}


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a if not same_bits(a[k], b[k])) + sorted(set(a) ^ set(b))


def load_into_state_dicts(root: str) -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    model, optim = make_fsdp2(seed=0)
    train_step(model, optim, 0, rank)
    bcp.save(f"{root}/bcp", {"model": model, "optimizer": optim})
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{root}/dcp")
    ref = _model_bits(model)
    for source in ("bcp", "dcp"):
        # FSDP2 on the same ranks: DTensor shards of the state dict, in place
        fsdp2, _ = make_fsdp2(seed=5)
        bcp.load(f"{root}/{source}", {"model": fsdp2.state_dict()})
        out[f"{source}->fsdp2"] = _differs(ref, _model_bits(fsdp2))
        # every rank a whole plain model (consolidation), in place
        plain, _ = make_plain(seed=5)
        sd = plain.state_dict()
        result = bcp.load(f"{root}/{source}", {"model": sd})
        out[f"{source}->plain"] = _differs(ref, _model_bits(plain))
        out[f"{source}->plain aliases"] = all(sd[k].data_ptr() == v.data_ptr()
                                              for k, v in plain.state_dict().items())
        out[f"{source}->plain bytes"] = result.bytes_read
    # a key the state dict lacks is named, not skipped
    plain, _ = make_plain(seed=5)
    sd = plain.state_dict()
    sd.pop(next(iter(sd)))
    out["missing"] = _missing_keys_error(f"{root}/bcp", {"model": sd})
    return out


def _missing_keys_error(path: str, state: dict[str, Any]) -> str | None:
    """The load's MissingKeysError message, None if it loaded."""
    try:
        bcp.load(path, state)
    except bcp.MissingKeysError as exc:
        return str(exc)
    return None


def test_module_and_dcp_checkpoints_load_into_plain_state_dicts(world, tmp_path):
    for r in world(2).run(load_into_state_dicts, str(tmp_path)):
        for source in ("bcp", "dcp"):
            assert r[f"{source}->fsdp2"] == [], source
            assert r[f"{source}->plain"] == [], source
            assert r[f"{source}->plain aliases"]
            assert r[f"{source}->plain bytes"] > 0
        assert r["missing"] is not None and "in the checkpoint but not in the state" in r["missing"]


def _differs_full(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = [k for k, v in a.items() if isinstance(v, torch.Tensor) and not same_bits(v, b.get(k, v * 0 + 1))]
    return sorted(out) + ([] if a["param_groups"] == b["param_groups"] else ["param_groups"])


def load_into_get_state_dict(root: str) -> dict[str, Any]:
    """DCP's idiom for a model and its optimizer: ``get_state_dict``, load into its dicts,
    ``set_state_dict``. Hyperparameters are changed before the load, so loading them is seen."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    model, optim = make_fsdp2(seed=0)
    train_step(model, optim, 0, rank)
    train_step(model, optim, 1, rank)
    bcp.save(f"{root}/bcp", {"model": model, "optimizer": optim})
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=f"{root}/dcp")
    ref = full_state(model, optim)
    for source in ("bcp", "dcp"):
        for layout in ("fsdp2", "plain"):  # the same ranks' shards, or every rank the whole state
            fresh, fresh_optim = (make_fsdp2 if layout == "fsdp2" else make_plain)(seed=5, lr=0.5)
            msd, osd = get_state_dict(fresh, fresh_optim)  # creates the optimizer state
            bcp.load(f"{root}/{source}", {"model": msd, "optimizer": osd})
            set_state_dict(fresh, fresh_optim, model_state_dict=msd, optim_state_dict=osd)
            out[f"{source}->{layout}"] = _differs_full(ref, full_state(fresh, fresh_optim))
    fresh, fresh_optim = make_fsdp2(seed=5)
    msd, osd = get_state_dict(fresh, fresh_optim)
    osd["state"].pop(next(iter(osd["state"])))  # one parameter's state left out: named
    out["missing"] = _missing_keys_error(f"{root}/bcp", {"model": msd, "optimizer": osd})
    return out


def test_optimizer_state_dicts_of_get_state_dict_load_from_bcp_and_dcp(world, tmp_path):
    for r in world(2).run(load_into_get_state_dict, str(tmp_path)):
        for source in ("bcp", "dcp"):
            for layout in ("fsdp2", "plain"):
                assert r[f"{source}->{layout}"] == [], (source, layout)
        assert r["missing"] is not None and "optimizer/state/" in r["missing"]
