"""Goodput: the paper's average ETTR from measured save and load times, and other intervals."""

from __future__ import annotations

import math

import numpy as np
import streamlit as st

from dashboard import figures, goodput, ui

st.title("Goodput (ETTR)")
st.markdown(
    "Average effective training time ratio, as in the ByteCheckpoint paper: a failure lands "
    "uniformly within a checkpoint interval of N iterations, so on average it wastes "
    "`(N·T_iter + T_save)/2 + T_load`, and `ETTR = N·T_iter / (N·T_iter + T_wasted)`. "
    "This model charges one failure per interval; for a rarer failure rate the real ETTR is higher."
)
job, run = ui.filters()
ckpts = ui.query("checkpoints", job=job, run=run)
saves, loads = ckpts[ckpts["op"] == "save"], ckpts[ckpts["op"] == "load"]
if saves.empty:
    ui.empty_state(ui.NO_DATA)

measured_iter = ui.query("iteration_time", job=job, run=run)
source = "median `train.step` span"
if measured_iter is None:
    measured_iter = goodput.estimated_iteration_s(saves)
    source = "time between saves, less their blocking time, per step"
interval = goodput.measured_interval(saves["step"])
save_s = float(saves["e2e_s"].median())
load_s = float(loads["e2e_s"].median()) if not loads.empty else 0.0

# Widget ranges, and defaults clamped into them: measured values can be anything the store
# holds (a toy loop's microsecond steps, negative durations from a broken clock, no value).
T_ITER_RANGE = (1e-9, 1e7)  # seconds per iteration
N_RANGE = (1, 10**9)  # steps between checkpoints
T_RANGE = (0.0, 1e9)  # save / load seconds
MAX_CURVE_POINTS = 400  # intervals the what-if curve evaluates


def clamped(value: float | None, bounds: tuple[float, float], fallback: float) -> float:
    """``value`` within ``bounds``; ``fallback`` when it is missing or not a finite number."""
    if value is None or not math.isfinite(value):
        value = fallback
    return min(max(value, bounds[0]), bounds[1])


cols = st.columns(4)
iter_help = f"measured from the {source}" if measured_iter else "not measured: enter it"
t_iter = cols[0].number_input("T_iter (s per iteration)", min_value=T_ITER_RANGE[0],
                              max_value=T_ITER_RANGE[1], value=clamped(measured_iter, T_ITER_RANGE, 1.0),
                              format="%.4g", key="t_iter", help=iter_help)
n = cols[1].number_input("N (checkpoint interval, steps)", min_value=N_RANGE[0], max_value=N_RANGE[1], step=1,
                         value=int(clamped(interval, N_RANGE, 100)), key="interval",
                         help="measured: median gap between saved steps" if interval else None)
t_save = cols[2].number_input("T_save (end-to-end s)", min_value=T_RANGE[0], max_value=T_RANGE[1],
                              value=clamped(save_s, T_RANGE, 0.0), format="%.3f", key="t_save",
                              help="median end-to-end save over the selection")
t_load = cols[3].number_input("T_load (s)", min_value=T_RANGE[0], max_value=T_RANGE[1],
                              value=clamped(load_s, T_RANGE, 0.0), format="%.3f", key="t_load",
                              help="median load" if not loads.empty else "no load recorded: enter it")

measured = {"T_iter": (measured_iter, T_ITER_RANGE), "N": (interval, N_RANGE), "T_save": (save_s, T_RANGE),
            "T_load": (load_s, T_RANGE)}
outside = [f"{name} {value:.4g}" for name, (value, bounds) in measured.items()
           if value is not None and math.isfinite(value) and not bounds[0] <= value <= bounds[1]]
if outside:
    st.caption("Measured values outside the inputs' ranges were clamped into them: " + ", ".join(outside)
               + ". Check the spans' durations and steps.")

inputs = goodput.GoodputInputs(iteration_s=t_iter, interval=int(n), save_s=t_save, load_s=t_load)
a, b = st.columns(2)
a.metric("Average ETTR", f"{goodput.ettr(inputs):.4f}")
b.metric("Wasted per failure", f"{goodput.wasted_s(inputs):.2f} s")
top = max(4 * int(n), 50)
# At most MAX_CURVE_POINTS intervals (always the current one), however large N is.
intervals = sorted({*np.linspace(1, top, MAX_CURVE_POINTS).round().astype(int).tolist(), int(n)})
whatif = goodput.what_if(inputs, intervals)
st.plotly_chart(figures.ettr_curve(whatif, current_n=int(n), title="What another interval would give"),
                width="stretch", key="ettr")
