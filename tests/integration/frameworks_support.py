"""Shared code of the trainer-integration tests: run a training job in fresh processes.

Trainers launch their own ranks (Lightning's DDP re-runs the script, Accelerate reads the
torch.distributed environment), so each job is a module of this folder run with
``python -m``; it writes what the test compares (losses, states) with torch.save under ``out``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a job starts its own world
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", PYTHONHASHSEED="0", **extra)
    return env


def run_job(module: str, *args: str, timeout: float = 180, env: dict[str, str] | None = None) -> str:
    """Run ``python -m tests.integration.<module> args``; fail with its output if it fails."""
    proc = subprocess.run([sys.executable, "-m", f"tests.integration.{module}", *args], cwd=REPO,
                          env=env or job_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{module} {' '.join(args)} exited {proc.returncode}:\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc.stdout + proc.stderr


def run_ranks(module: str, world: int, *args: str, timeout: float = 180) -> None:
    """Run ``world`` ranks of a job with the torch.distributed environment (as torchrun sets it)."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = job_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", f"tests.integration.{module}", *args], cwd=REPO,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs, failed = [], False
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            out = f"TIMEOUT after {timeout}s\n{out}"
            failed = True
        failed = failed or proc.returncode != 0
        outputs.append(out)
    if failed:
        raise AssertionError("\n".join(f"--- rank {r} (exit {p.returncode}) ---\n{o[-6000:]}"
                                       for r, (p, o) in enumerate(zip(procs, outputs))))


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of nested dicts / lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: tensor vs {type(b).__name__}"
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), \
            f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
