"""Fuzzing ``bcp`` argument vectors: subcommands over hostile paths and option values.

Each vector runs ``bytecheckpoint.cli.app`` in the guarded worker against a fresh
workspace (checkpoints, a corrupt one, a FIFO where a data file should be, a directory in
its place, a plain file, a symlink out of the root). Acceptable: a documented exit code and
no traceback; a hang (a FIFO opened for reading) or a file deleted outside the workspace's
targets fails the test.
"""

from __future__ import annotations

import pytest
from hypothesis import given

from tests.fuzz import cli, corpus, session
from tests.fuzz.strategies import argvs, fuzz_settings

pytestmark = pytest.mark.fuzz


@fuzz_settings(40)
@given(argvs(cli.PLACEHOLDER_PATHS))
def test_bcp_argument_vectors_exit_with_a_documented_code_and_no_traceback(argv):
    case = ["cli", argv]
    session.check(session.guard().case(case), case)


@pytest.mark.parametrize("argv", [
    ["verify", "{ws}/fifo"], ["verify", "{ws}/dirfile"], ["verify", "{ws}/devnull"],
    ["inspect", "{ws}/plain.txt"],
    ["verify", "{ws}/root", "--threads", "0"], ["gc", "{ws}/root", "--keep-last", "0", "--yes"],
    ["gc", "{ws}/root", "--keep-last", "1", "--yes", "--cold", "{ws}/cold"], ["inspect", "s3://"],
    ["export", "{ws}/truncated", "{ws}/out"], ["export", "{ws}/root", "{ws}/root/step_1", "--overwrite"],
])
def test_known_hostile_command_lines(argv):
    case = ["cli", argv]
    session.check(session.guard().case(case), case)


@pytest.mark.parametrize("name,case", corpus.load("cli"), ids=lambda v: v if isinstance(v, str) else "")
def test_corpus(name, case):
    session.check(session.guard().case(case), case)
