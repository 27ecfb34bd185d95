"""The demo's rank function: FSDP2 training with periodic checkpoints, or a resumed run."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import bytecheckpoint as bcp
import telemetry
from bytecheckpoint.data import TokenLoader
from demo.model import GPT, GPTConfig, loss_fn

DEMO_CONFIG = GPTConfig(vocab_size=4099, context=64, dim=256, heads=8, layers=4, mlp_ratio=4)


@dataclass
class JobSpec:
    root: str
    first_step: int  # 0 for a fresh run; resumed runs start after the loaded step
    steps: int
    save_every: int
    resume: bool
    sources: list[str]


def _runs(batch) -> list[list[int]]:  # noqa: ANN001
    """(sample id, first token, tokens) of every run of sample tokens in a batch."""
    return [[int(i), int(s), int(n)] for p in batch.pieces for i, s, n in zip(p.ids, p.starts, p.lengths)]


def fingerprint(model: torch.nn.Module, optim: torch.optim.Optimizer) -> str:
    """A hash of the full (gathered) model and optimizer state, equal on any layout."""
    h = hashlib.sha256()
    tensors = dict(model.state_dict())
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in optim.state.items():
        for k, v in st.items():
            tensors[f"optim.{names[id(p)]}.{k}"] = v
    for key in sorted(tensors):
        t = tensors[key]
        t = t.full_tensor() if isinstance(t, DTensor) else t
        h.update(key.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(DEMO_CONFIG)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def run_rank(rank: int, world: int, port: int, spec_json: str) -> None:
    spec = JobSpec(**json.loads(spec_json))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    telemetry.set_context(job="demo", run=f"world{world}", rank=rank, world_size=world, dp=rank)
    model, optim = build(world)
    # Two weighted sources, packed into 65-token windows by 2 reader processes per rank;
    # the loader's state is prepared during the step before each checkpoint.
    loader = TokenLoader(spec.sources, [3.0, 1.0], context=DEMO_CONFIG.context, batch_size=8,
                         workers=2, checkpoint_every=spec.save_every, buffer_tokens=2048)
    extra: dict = {}
    state = {"model": model, "optimizer": optim, "dataloader": loader, "rng": bcp.RNGState(),
             "extra_state": extra}
    ckpt_root = f"{spec.root}/checkpoints"
    record: dict = {"rank": rank, "world": world, "saves": [], "losses": {}, "data": {}}
    # The manager saves every save_every steps and at the last one, keeps the newest 3, and
    # resumes from the latest checkpoint (None on a fresh start). Synchronous here, so each
    # save's timings can be reported as it ends.
    last = spec.first_step + spec.steps if not spec.resume else None
    mgr = bcp.CheckpointManager(ckpt_root, save_every_steps=None if spec.resume else spec.save_every,
                                last_step=last, retention=bcp.KeepLast(3), async_save=False)
    if spec.resume:
        spec.first_step = mgr.restore(state) or 0
        result = mgr.last_load
        record["load"] = {"path": result.path, "step": result.step, "seconds": result.duration_s,
                          "bytes_read": result.bytes_read, "phases": result.phases}
        record["fingerprint_after_load"] = fingerprint(model, optim)
    for step in range(spec.first_step, spec.first_step + spec.steps):
        batch = next(loader)
        record["data"][step + 1] = _runs(batch)
        loss = loss_fn(model, batch.inputs, batch.targets)
        loss.backward()
        optim.step()
        optim.zero_grad()
        record["losses"][step + 1] = loss.item()
        done = step + 1
        extra["step"] = done
        t = time.perf_counter()
        if not spec.resume and mgr.save(done, state):
            res = mgr.last_result
            record["saves"].append({"step": done, "path": res.path, "seconds": time.perf_counter() - t,
                                    "bytes": res.bytes_written, "total_bytes": res.total_bytes,
                                    "metadata_bytes": res.metadata_bytes, "files": res.files,
                                    "phases": res.phases, "loader_collect_s": loader.last_collect_s,
                                    "loader_prefetched": loader.last_collect_prepared})
            record["fingerprint_at_last_save"] = fingerprint(model, optim)
    mgr.close()
    if spec.resume:  # read the rest of the data, to show every token comes exactly once
        record["drained"] = [run for b in loader for run in _runs(b)]
    loader.close()
    telemetry.flush()
    with open(f"{spec.root}/stats/{'resume' if spec.resume else 'train'}-rank{rank}.json", "w") as f:
        json.dump(record | {"spec": asdict(spec)}, f)
    dist.destroy_process_group()
