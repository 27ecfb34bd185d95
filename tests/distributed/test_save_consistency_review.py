"""What a save does when ranks offer the same tensor with different values (review).

A box several ranks offer is a replica and is written once. Replicas that differed (DDP
ranks out of sync, pipeline stages that name their layers alike, a per-rank buffer, a
``Replicate`` DTensor or ``TensorShard`` replica of its own) were committed silently as one
rank's values, or, for a tensor large enough to be written in row pieces by several ranks, as
a mix of both copies that no rank held. Now the holders' sampled digests are compared before
the commit and the save is refused by name, on a cached plan too."""

from __future__ import annotations

from tests.support import save_consistency_workloads as cw


def test_replicas_that_differ_are_refused_and_agreeing_ones_round_trip(world, tmp_path):
    results = world(2).run(cw.diverged_replicas, str(tmp_path))
    for rank, r in enumerate(results):
        for case, key in [("ddp", "model/"), ("split", "model/w"), ("tensor_shard", "m/w"),
                          ("dtensor", "model/w"), ("async", "model/c"), ("overlapped", "model/c"),
                          ("host_files", "model/c")]:
            refused = "PlanningError: ranks 0 and 1 hold different values of "
            assert r[case].startswith(refused), (rank, case, r[case])
            assert key in r[case] and "Nothing was committed" in r[case], (rank, case, r[case])
        assert r["agree"] == "committed" and r["agree_exact"] is True, (rank, r)
        assert r["agree_cached"] is True
        # The cached plan's save names the one diverged buffer, not the agreeing tensors.
        assert r["cached"].startswith("PlanningError: ranks 0 and 1 hold different values of "
                                      "buffers/step, which"), (rank, r["cached"])
        assert r["cached_after"] is False  # the refused save dropped the plan cache
        # No refused checkpoint and no staging left.
        assert r["left"] == ["after", "agree", "agree2", "latest"], r["left"]


def test_pipeline_stages_save_their_own_layers_once_and_load_into_another_split(world, tmp_path):
    results = world(2).run(cw.pipeline_stages, str(tmp_path))
    for r in results:
        assert r["no_map"].startswith("PlanningError: ranks 0 and 1 hold different values of model/0."), r
        assert r["same_split"] is True and r["other_split"] is True, r


def test_differing_replicas_setting_and_samples_of_save_time(world, tmp_path):
    results = world(2).run(cw.replica_settings, str(tmp_path))
    for rank, r in enumerate(results):
        assert r["warn"] == "committed" and r["off"] == "committed", (rank, r)
        assert r["warn_warned"] is (rank == 0), (rank, r)  # the coordinator compares, and says so
        assert r["off_warned"] is False, (rank, r)
        assert r["warn_loaded"] in (0, 1), r  # one rank's copy, as the setting says
        assert r["maybe"].endswith("BCP_DIFFERING_REPLICAS='maybe': expected one of refuse, warn, off"), r
        assert r["later"] == "committed", (rank, r["later"])
