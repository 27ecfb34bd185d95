"""The long run's tally: counts merged from its workers, each case counted once."""

from __future__ import annotations

from tests.fuzz.outcomes import OK, WRONG, Result, Tally


def test_a_merged_tally_counts_each_bad_case_once_and_keeps_its_finding():
    worker = Tally()
    worker.add("verify", Result(OK), ["case", 1])
    worker.add("verify", Result(WRONG, "verify passed a changed file"), ["case", 2])
    parent = Tally()
    for _ in range(2):  # two workers' batches, as the guard and the long run merge them
        parent.merge({f"{t}:{k}": n for (t, k), n in worker.counts.items()}, worker.findings)
    assert parent.counts[("verify", WRONG)] == 2 and parent.counts[("verify", OK)] == 2
    assert parent.bad == 2
    assert [f["case"] for f in parent.findings] == [["case", 2], ["case", 2]]


def test_a_tally_keeps_at_most_its_limit_of_findings_per_target_and_kind():
    tally = Tally(keep=3)
    for i in range(5):
        tally.add("object", Result(WRONG, "x"), i)
    tally.merge({"object:wrong": 2}, [{"target": "object", "kind": WRONG, "case": 9, "detail": "x"}])
    assert tally.counts[("object", WRONG)] == 7 and len(tally.findings) == 3
