"""Rank functions for the Hugging Face export tests: a ``transformers`` GPT-2 (built from a
config, random weights, nothing downloaded) trained under FSDP2 with bytecheckpoint saves,
and a load of an imported checkpoint into FSDP2."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import bytecheckpoint as bcp

VOCAB = 128


def gpt2_config() -> Any:
    from transformers import GPT2Config

    # No dropout, so training-time and evaluation forwards are the same function.
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, bos_token_id=0,
                      eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def probe_input() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1234))


def _fsdp2_gpt2(seed: int) -> torch.nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(gpt2_config())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def fsdp2_gpt2_train_save(root: str, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps on 4 ranks, saving after each; return the probe logits (computed
    by the FSDP2 training model itself) and the full final state."""
    model = _fsdp2_gpt2(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = json.loads(model.config.to_json_string())
    rank = dist.get_rank()
    for step in range(1, steps + 1):
        x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step * 100 + rank))
        model(x, labels=x).loss.backward()
        optim.step()
        optim.zero_grad()
        bcp.save(f"{root}/step_{step}", {"model": model, "optimizer": optim}, step=step,
                 user_metadata={"hf_config": config})
    model.eval()
    with torch.no_grad():
        logits = model(probe_input()).logits.detach().clone()
    return {"logits": logits, "state": _full_state(model)}


def fsdp2_gpt2_load(path: str) -> dict[str, torch.Tensor]:
    """Load a checkpoint into a freshly initialized FSDP2 GPT-2 (other seed) on this world."""
    model = _fsdp2_gpt2(99)
    bcp.load(path, {"model": model})
    return _full_state(model)
