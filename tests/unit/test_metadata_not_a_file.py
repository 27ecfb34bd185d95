"""A directory where a committed checkpoint's ``metadata.msgpack`` should be (or a file where its
checkpoint directory should be): the load, ``bcp verify`` and ``bcp inspect`` name the damaged
metadata file. They raised a raw ``IsADirectoryError`` inside two ``RankFailedError`` layers, and
the CLI called it a storage error."""

from __future__ import annotations

import os

import pytest
import torch

import bytecheckpoint as bcp
from bytecheckpoint.cli import app as cli
from bytecheckpoint.errors import CorruptCheckpointError


@pytest.fixture
def damaged(tmp_path):
    path = str(tmp_path / "step_1")
    bcp.save(path, {"w": torch.arange(4.0)}, step=1)
    meta = os.path.join(path, "metadata.msgpack")
    os.unlink(meta)
    os.mkdir(meta)
    return str(tmp_path), path


def test_a_load_names_the_metadata_file_as_damaged(damaged):
    root, path = damaged
    target = {"w": torch.zeros(4)}
    for url in (path, root):  # the checkpoint, and the root whose 'latest' names it
        with pytest.raises(CorruptCheckpointError, match="msgpack: the metadata file is a directory"):
            bcp.load(url, target)
    assert torch.equal(target["w"], torch.zeros(4))


def test_verify_and_inspect_report_a_corrupt_checkpoint(damaged, capsys):
    _, path = damaged
    for command in ("verify", "inspect"):
        assert cli.main([command, path]) == 4  # corrupt checkpoint (a storage error is 6)
        assert "the metadata file is a directory" in capsys.readouterr().err
