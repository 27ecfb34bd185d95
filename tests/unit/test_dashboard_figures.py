"""Unit tests of the dashboard's pure parts: frames (reshaping), figures, goodput (ETTR)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from dashboard import figures, frames, goodput
from tests.support.browser import rendered


def phases_frame(tp: int = 2, dp: int = 2, pp: int = 2, slow_rank: int | None = None) -> pd.DataFrame:
    """rank_phases-shaped rows for a TP x DP x PP job: plan, write (bytes), commit, whole call."""
    rows = []
    for rank in range(tp * dp * pp):
        write = 1.0 + 0.01 * rank + (5.0 if rank == slow_rank else 0.0)
        spans = (("save.plan", 0.0, 0.1, 0), ("save.write", 0.1, write, 1000 * (rank + 1)),
                 ("save.commit", 0.1 + write, 0.05, 0), ("save", 0.0, 7.0, 0))
        for phase, start, dur, nbytes in spans:
            rows.append({"rank": rank, "phase": phase, "spans": 1, "duration_s": dur,
                         "start_ts": 100 + start, "end_ts": 100 + start + dur, "bytes": nbytes, "errors": 0,
                         "tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp),
                         "host": f"h{rank // 4}", "step": 3})
    return pd.DataFrame(rows)


def test_heatmap_has_one_cell_per_rank_per_stage_with_its_value():
    phases = phases_frame()
    cells, by_rank = frames.layout_coords(frames.heatmap_cells(phases, "save", "save.write", "duration"))
    assert not by_rank and len(cells) == 8
    fig = figures.topology_heatmap(cells, title="t", colorbar="s", flagged=[5])
    heatmaps = [t for t in fig.data if t.type == "heatmap"]
    assert [t.name for t in heatmaps] == ["pp 0", "pp 1"]
    for trace in heatmaps:
        stage = int(trace.name.split()[-1])
        z = np.asarray(trace.z, dtype=float)
        assert z.shape == (2, 2) and not np.isnan(z).any()
        for _, row in phases[(phases["phase"] == "save.write") & (phases["pp"] == stage)].iterrows():
            assert z[row["tp"], row["dp"]] == row["duration_s"]
            assert f"rank {row['rank']}" in trace.text[row["tp"]][row["dp"]]
    [mark] = [t for t in fig.data if t.type == "scatter"]
    assert (list(mark.x), list(mark.y)) == ([0], [1])  # rank 5: pp 1, tp 1, dp 0
    assert "flagged slow" in heatmaps[1].text[1][0]


def test_heatmap_throughput_and_breakdown_hover():
    cells = frames.heatmap_cells(phases_frame(), "save", "save.write", "throughput")
    assert cells.loc[cells["rank"] == 3, "value"].item() == pytest.approx(4000 / 1.03)
    hover = cells.loc[cells["rank"] == 0, "breakdown"].item()
    assert hover.startswith("save 7.000 s<br>save.plan 0.100 s<br>save.write 1.000 s")
    whole = frames.heatmap_cells(phases_frame(), "save", frames.WHOLE_CALL, "duration")
    assert set(whole["value"]) == {7.0}


def test_ranks_without_coordinates_are_laid_out_by_rank():
    phases = phases_frame().assign(tp=None, dp=None, pp=None)
    cells, by_rank = frames.layout_coords(frames.heatmap_cells(phases, "save", "save.plan", "duration"))
    assert by_rank and len(cells.drop_duplicates(["pp", "tp", "dp"])) == 8


def test_timeline_has_one_bar_per_rank_and_phase_relative_to_the_first_span():
    phases = phases_frame(slow_rank=6)
    bars = frames.timeline_bars(phases)
    assert len(bars) == 8 * 3 and bars["start_s"].min() == 0.0
    fig = figures.timeline(bars, title="t")
    assert sum(len(t.y) for t in fig.data) == 24
    assert {t.name for t in fig.data} == {"save.plan", "save.write", "save.commit"}
    subset = frames.timeline_bars(phases, [1, 6])
    assert set(subset["rank"]) == {1, 6}
    assert frames.slowest_ranks(phases, 1) == [6]


def test_rank_breakdown_compares_with_the_median():
    phases = phases_frame(slow_rank=6)
    table = frames.rank_breakdown(phases, 6)
    assert list(table["phase"]) == ["save.plan", "save.write", "save.commit"]
    write = table.set_index("phase").loc["save.write"]
    assert write["duration_s"] == pytest.approx(6.06) and write["median_s"] == pytest.approx(1.035)
    assert len(figures.rank_breakdown(table, rank=6, title="t").data) == 2


def test_empty_inputs_give_a_figure_that_says_so():
    empty = frames.heatmap_cells(phases_frame().iloc[0:0], "save", "save.plan", "duration")
    fig = figures.topology_heatmap(empty, title="t", colorbar="s")
    assert "no ranks" in fig.layout.annotations[0].text
    assert "no storage" in figures.io_latency(pd.DataFrame(), title="t").layout.annotations[0].text


def test_trend_and_io_figures():
    ckpts = pd.DataFrame({"op": ["save", "save", "load"], "step": [4, 8, None], "blocking_s": [1.0, 2.0, 3.0],
                          "e2e_s": [1.5, 2.5, 3.5]})
    fig = figures.step_durations(ckpts, title="t")
    assert [t.name for t in fig.data] == ["save blocking", "save end to end"]
    latency = pd.DataFrame({"backend": ["file", "file"], "op": ["read", "write"], "ops": [3, 4],
                            "bytes": [1, 2], "min_s": [0.1, 0.2], "p25_s": [0.2, 0.3], "p50_s": [0.3, 0.4],
                            "p75_s": [0.4, 0.5], "p99_s": [0.5, 0.6], "max_s": [0.9, 1.0], "errors": [0, 0]})
    boxes = [t for t in figures.io_latency(latency, title="t").data if t.type == "box"]
    assert list(boxes[0].median) == [0.3, 0.4] and list(boxes[0].upperfence) == [0.5, 0.6]
    io = pd.DataFrame({"bucket_ts": [0.0, 60.0], "backend": ["file"] * 2, "op": ["write"] * 2,
                       "bytes": [6e7, 0], "bytes_per_s": [1e6, 0.0]})
    [line] = figures.io_throughput(io, title="t", bucket_s=60).data
    assert list(line.y) == [1.0]
    assert frames.io_bucket_s(3600) == 30 and frames.io_bucket_s(10) == 1


def test_ettr_is_the_papers_formula():
    g = goodput.GoodputInputs(iteration_s=2.0, interval=100, save_s=30.0, load_s=60.0)
    wasted = (100 * 2.0 + 30.0) / 2 + 60.0
    assert goodput.wasted_s(g) == wasted
    assert goodput.ettr(g) == pytest.approx(200 / (200 + wasted))
    table = goodput.what_if(g, [50, 100, 200])
    assert table.loc[table["interval"] == 100, "ettr"].item() == goodput.ettr(g)
    assert table["ettr"].is_monotonic_increasing  # one failure per interval: longer intervals amortise T_load
    with pytest.raises(ValueError):
        goodput.GoodputInputs(iteration_s=0, interval=1, save_s=0, load_s=0)


def test_goodput_inputs_measured_from_checkpoints():
    saves = pd.DataFrame({"step": [10, 20, 30], "start_ts": [0.0, 25.0, 50.0], "blocking_s": [5.0, 5.0, 5.0]})
    assert goodput.measured_interval(saves["step"]) == 10
    assert goodput.estimated_iteration_s(saves) == pytest.approx(2.0)
    assert goodput.estimated_iteration_s(saves.iloc[:1]) is None


def test_tiering_state_and_tiers():
    def ev(name, ckpt, ts, outcome="ok", nbytes=0, dur=0.0):
        return {"name": name, "checkpoint": ckpt, "tier": "cold", "bytes": nbytes, "files": 2, "to_cool": 0,
                "to_delete": 0, "outcome": outcome, "error": "", "ts": ts, "duration_s": dur}

    moves = pd.DataFrame([
        ev("tiering.scan", "", 0.5, nbytes=5000) | {"to_cool": 2, "to_delete": 1},
        ev("tiering.move", "a", 1.0, nbytes=100, dur=2.0),
        ev("tiering.begin", "b", 5.0),
        ev("tiering.move", "c", 6.0, outcome="error", dur=1.0),
        ev("tiering.delete", "d", 7.0, nbytes=300),
    ])
    state = frames.tiering_state(moves).set_index("checkpoint")
    assert state.loc["a", "tier"] == "cold" and state.loc["a", "bytes_moved"] == 100
    assert bool(state.loc["b", "in_progress"]) and not bool(state.loc["a", "in_progress"])
    assert state.loc["c", "failed"] == 1 and state.loc["c", "tier"] == "hot"
    assert state.loc["d", "tier"] == "deleted" and "" not in state.index
    assert frames.last_scan(moves)["bytes"] == 5000
    ckpts = pd.DataFrame({"checkpoint": ["a", "c", "a"], "op": ["save", "save", "load"]})
    assert list(frames.with_tiers(ckpts, moves)["tier"]) == ["cold", "hot", ""]


def test_blank_screenshots_are_not_taken_for_rendered_pages(tmp_path):
    blank = tmp_path / "blank.png"
    Image.new("RGB", (1400, 900), "white").save(blank)
    ok, why = rendered(blank)
    assert not ok and "1 colours" in why
    # Widgets drawn but no chart yet: grey text on white passes the basic check, not the chart one.
    page = tmp_path / "widgets.png"
    img = Image.new("RGB", (1400, 900), "white")
    for i in range(120):
        img.paste((i, i, i + 20), (400 + 5 * i, 100, 404 + 5 * i, 400))
    img.save(page)
    assert rendered(page)[0] and not rendered(page, min_chart=0.005)[0]


def test_slot_waits_show_each_rank_s_seconds_and_say_when_none_waited():
    waits = pd.DataFrame({"rank": [0, 1, 2], "commits": [3, 3, 3], "waited": [0, 2, 1],
                          "wait_s": [0.0, 1.25, 0.5]})
    fig = figures.slot_waits(waits, title="t")
    [bar] = fig.data
    assert list(bar.x) == ["rank 0", "rank 1", "rank 2"] and list(bar.y) == [0.0, 1.25, 0.5]
    assert [list(row) for row in bar.customdata] == [[0, 3], [2, 3], [1, 3]]
    none = figures.slot_waits(waits.assign(wait_s=0.0, waited=0), title="t")
    assert not none.data and "no file" in none.layout.annotations[0].text
