"""Adversarial testing harness: mutators, outcome oracles, a crash guard and a seeded corpus.

The fuzz tests (``tests/test_fuzz_*.py``) and the long run (``scripts/fuzz_long.sh``) share
everything here. A case's only acceptable outcomes are an exact success or a named error
(see :mod:`tests.fuzz.outcomes`); docs/threat-model.md says what each target covers.
"""
