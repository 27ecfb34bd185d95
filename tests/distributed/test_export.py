"""``bcp export`` read by a real client, and ``bcp import`` loaded back with resharding.

A ``transformers`` GPT-2 (from a config, random weights) trains 3 steps under FSDP2 on 4 ranks
with bytecheckpoint saves; ``bcp export`` (the command line, in its own process) writes Hugging
Face shards; ``AutoModelForCausalLM.from_pretrained`` in a fresh process gives the training
model's logits bit for bit. ``bcp import`` of that directory loads into FSDP2 on 2 ranks with
every tensor bit-identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.support import export_workloads as w
from tests.support.helpers import same_bits

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3

FRESH_CLIENT = """
import sys, torch, transformers
from safetensors.torch import save_file
from tests.support.export_workloads import probe_input
torch.set_num_threads(1)  # as the training ranks
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
model.eval()
with torch.no_grad():
    logits = model(probe_input()).logits
wte, head = model.transformer.wte.weight, model.lm_head.weight
save_file({"logits": logits.contiguous(), "wte": wte.detach().clone(), "lm_head": head.detach().clone(),
           "shared": torch.tensor(wte.data_ptr() == head.data_ptr())}, sys.argv[2])
print(type(model).__name__, logits.dtype)
"""


def bcp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bytecheckpoint.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gpt2") / "run")
    ref = world(4).run(w.fsdp2_gpt2_train_save, root, STEPS)[0]
    return root, ref


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    root, _ = trained
    out = str(tmp_path_factory.mktemp("hf") / "gpt2")
    # 40 KB shards: the 72 KB-ish model is split into several files, one tensor per file at most
    # for the larger ones, which exercises the index.
    r = bcp("export", root, out, "--format", "safetensors", "--max-shard-size", "40KB", "--json")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


def test_export_writes_hf_shards_index_and_config(trained, exported):
    out, summary = exported
    names = sorted(os.listdir(out))
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) > 2 and all(n.endswith(f"-of-{len(shards):05d}.safetensors") for n in shards)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert sorted(set(index["weight_map"].values())) == shards
    # The tied output embedding is written once; the index records the pair.
    assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
    assert index["metadata"]["bcp_tied"] == "lm_head.weight=transformer.wte.weight"
    assert summary["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    total = 0
    for n in shards:
        size = os.path.getsize(os.path.join(out, n))
        tensors = load_file(os.path.join(out, n))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert nbytes <= 40_000 or len(tensors) == 1, (n, nbytes)
        assert size > nbytes
        total += nbytes
    assert index["metadata"]["total_size"] == total
    assert json.load(open(os.path.join(out, "config.json")))["n_layer"] == 2
    # Every exported tensor equals the training model's final full tensor, bit for bit.
    _, ref = trained
    for name, fname in index["weight_map"].items():
        assert same_bits(load_file(os.path.join(out, fname))[name], ref["state"][name]), name


def test_from_pretrained_gives_the_training_logits_bit_for_bit(trained, exported, tmp_path):
    out, _ = exported
    _, ref = trained
    result = tmp_path / "client.safetensors"
    r = subprocess.run([sys.executable, "-c", FRESH_CLIENT, out, str(result)], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GPT2LMHeadModel torch.float32" in r.stdout
    got = load_file(str(result))
    assert same_bits(got["wte"], ref["state"]["transformer.wte.weight"])
    assert same_bits(got["lm_head"], ref["state"]["transformer.wte.weight"])
    assert bool(got["shared"])  # tied again by transformers, from the one stored copy
    assert ref["logits"].dtype == torch.float32
    assert same_bits(got["logits"], ref["logits"])


def test_import_loads_into_fsdp2_on_two_ranks_bit_exactly(world, trained, exported, tmp_path):
    out, _ = exported
    _, ref = trained
    dst = str(tmp_path / "imported" / "step_0")
    r = bcp("import", out, dst, "--step", "0")
    assert r.returncode == 0, r.stderr
    assert "tied: lm_head.weight = transformer.wte.weight" in r.stdout
    got = world(2).run(w.fsdp2_gpt2_load, dst)[0]
    hf = {}
    for n in os.listdir(out):
        if n.startswith("model-"):
            hf.update(load_file(os.path.join(out, n)))
    assert sorted(got) == sorted(ref["state"])
    for name, tensor in got.items():
        assert same_bits(tensor, hf.get(name, hf["transformer.wte.weight"])), name
        assert same_bits(tensor, ref["state"][name]), name
    # The HF config travels with the imported checkpoint, so a second export needs no --config.
    again = str(tmp_path / "again")
    r = bcp("export", dst, again, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config"] is True


def test_export_with_optimizer_writes_a_separate_set(trained, tmp_path):
    root, _ = trained
    out = str(tmp_path / "with_optim")
    r = bcp("export", root, out, "--include-optimizer", "--max-shard-size", "1MB", "--json")
    assert r.returncode == 0, r.stderr
    index = json.load(open(os.path.join(out, "optimizer.safetensors.index.json")))
    assert "transformer.h.0.attn.c_attn.weight.exp_avg" in index["weight_map"]
    assert "transformer.h.0.attn.c_attn.weight.exp_avg_sq" in index["weight_map"]
    model_index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert not any(k.endswith(".exp_avg") for k in model_index["weight_map"])
