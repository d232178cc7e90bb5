"""The step-time cost model (distflow_lab.experiments.sim): monotone where it must be, the
paper's Table 1 ratio and Fig. 9 band under `paper_calibration`, `calibrate`
recovering known parameters from synthetic spans, constant-batch sub-linearity,
and the figure's traces. No Ray: everything here is arithmetic on DataFrames."""
from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from distflow_lab.experiments import sim
from distflow_lab.core.spans import DRIVER, SPAN_COLUMNS

DEVICES = [8, 16, 32, 64, 128, 256, 512]
L = 16384  # the paper's Table 1 context: 8k prompt + 8k response
STAGES = ["data", "rollout", "reward", "advantage", "old_log_prob", "ref_log_prob", "actor_update"]


def by_mode(pred: pd.DataFrame, mode: str) -> pd.DataFrame:
    return pred[pred["mode"] == mode].set_index("devices")


@pytest.fixture(scope="module")
def paper() -> sim.Calibration:
    return sim.paper_calibration()


# ---- monotonicity ----------------------------------------------------------------------
@pytest.mark.parametrize("cal", [sim.paper_calibration(), sim.Calibration()], ids=["paper", "defaults"])
def test_centralized_grows_distributed_per_device_does_not(cal):
    pred = sim.predict(cal, DEVICES, "proportional", L)
    c, d = by_mode(pred, "centralized"), by_mode(pred, "distributed")
    assert c["data_plane_s"].is_monotonic_increasing and c["data_plane_s"].diff().dropna().gt(0).all()
    assert c.loc[512, "data_plane_s"] / c.loc[64, "data_plane_s"] > 0.75 * 512 / 64  # ~linear in D
    # distributed: per-device bytes are constant, so their cost is bounded by the all-cross-node limit;
    # only the per-object overhead grows (a consumer gets a piece from each of D producers)
    per_dev = cal.rho * cal.batch_per_device * L * cal.beta
    limit = cal.redistributions * per_dev * (2 * cal.b_local + cal.b_net)
    byte_part = d["transfer_s"] - cal.redistributions * (d["nodes"] + d.index) * cal.o_obj
    assert (byte_part <= limit * (1 + 1e-9)).all()
    assert byte_part.loc[512] / byte_part.loc[64] < 1.1
    assert (d["data_plane_s"] < c["data_plane_s"]).all()
    growth = {m: x.loc[512, "data_plane_s"] / x.loc[8, "data_plane_s"] for m, x in (("d", d), ("c", c))}
    assert growth["d"] < 0.25 * growth["c"]
    assert d["compute_s"].max() / d["compute_s"].min() < 1.01  # same work per device at every size


def test_per_device_batch_and_throughput_columns(paper):
    pred = sim.predict(paper, [32, 64], "proportional", L, mode="distributed")
    assert list(pred["batch"]) == [16384, 32768]
    np.testing.assert_allclose(pred["throughput"], pred["batch"] * L / pred["step_s"])
    np.testing.assert_allclose(pred["step_s"], pred["compute_s"] + pred["transfer_s"] + pred["control_s"])
    assert pred["scaling_efficiency"].iloc[0] == pytest.approx(1.0)


# ---- the paper ------------------------------------------------------------------------
def test_paper_table1_dataplane_ratio(paper):
    at32 = sim.predict(paper, [32], "proportional", L).set_index("mode")
    ratio = at32.loc["distributed", "transfer_s"] / at32.loc["centralized", "transfer_s"]
    assert ratio == pytest.approx(sim.PAPER["table1_dataplane_ratio"], rel=0.10)
    assert at32.loc["distributed", "transfer_s"] == pytest.approx(10.405, rel=0.01)
    assert at32.loc["centralized", "transfer_s"] == pytest.approx(101.659, rel=0.01)
    assert at32.loc["distributed", "compute_s"] == pytest.approx(81.196, rel=0.01)
    assert paper.batch_per_device * 32 == 512 * 4 * 8  # 512 prompts/node x 8 responses on 4 nodes


@pytest.mark.parametrize("fit", [False, True])
def test_paper_scaling_efficiency_32_to_512(fit):
    pred = sim.predict(sim.paper_calibration(fit_fig9=fit), [32, 64, 128, 256, 512], "proportional", L)
    eff = by_mode(pred, "distributed")["scaling_efficiency"]
    assert 0.85 <= eff.loc[512] <= 1.0
    assert eff.is_monotonic_decreasing
    if fit:
        assert eff.loc[512] == pytest.approx(np.mean(list(sim.PAPER["fig9_scaling_efficiency"].values())), abs=2e-3)
    assert by_mode(pred, "centralized")["scaling_efficiency"].loc[512] < 0.5


def test_constant_batch_is_sublinear(paper):
    pred = sim.predict(paper, [32, 64, 128, 256, 512], 16384, L)
    d, c = by_mode(pred, "distributed"), by_mode(pred, "centralized")
    assert d["throughput"].is_monotonic_increasing  # still faster with more devices...
    assert d["scaling_efficiency"].is_monotonic_decreasing and d.loc[512, "scaling_efficiency"] < 0.9  # ...sub-linearly
    assert (pred["batch"] == 16384).all()
    assert c.loc[512, "throughput"] < 2 * c.loc[32, "throughput"]  # the driver caps the centralized mode
    prop = by_mode(sim.predict(paper, [32, 512], "proportional", L), "distributed")
    assert d.loc[512, "scaling_efficiency"] < prop.loc[512, "scaling_efficiency"]


def test_imbalance_from_constrained_lpt():
    assert sim.imbalance(1, 16) == 1.0
    few, many = sim.imbalance(32, 2), sim.imbalance(32, 64)
    assert few > many >= 1.0
    assert sim.imbalance(512, 1) > sim.imbalance(32, 1)  # one item each: the longest of more items


# ---- calibration from spans -----------------------------------------------------------
TRUTH = dict(c=2e-7, o_call=1.5e-3, o_stage=1e-3, o_obj=4e-4, b_local=1e-9, b_drv=8e-10, b_nic=1.5e-9,
             b_wrk=2e-9, b_concat=1e-10)
B_NET = sim.Calibration().b_net  # one run cannot split DistFlow's get into local and cross-node: base's b_net
B, CTX, D, NODES = 64, 1024, 4, 2


def fake_spans(mode: str, steps: int = 3, noise: float = 0.03, seed: int = 0) -> pd.DataFrame:
    """Spans shaped like the controllers' (phases, driver rows, bytes) with durations
    drawn from the model with TRUTH, +-3 % noise."""
    t = TRUTH
    rng = np.random.default_rng(seed)
    jit = lambda x: x * (1 + noise * rng.uniform(-1, 1))  # noqa: E731
    nodes = {w: f"n{w * NODES // D}" for w in range(D)}
    wb = B * CTX * 40.0  # final batch bytes (beta = 40)
    comp = t["c"] * B * CTX / D * sim.imbalance(D, B / D) / len(STAGES)
    rows, now = [], 0.0

    def add(step, stage, worker, phase, sec, nbytes=0):
        rows.append(dict(batch_id=step, stage=stage, worker=worker, node="n0" if worker == DRIVER else nodes[worker],
                         phase=phase, start=now, end=now + sec, bytes=int(nbytes), items=0, tokens=0,
                         cache_hit=None, mode=mode))
        return sec

    for step in range(1, steps + 1):
        if mode == "distributed":
            for stage in STAGES:
                now += jit(t["o_stage"])  # the first one falls before the step's first span
                longest = 0.0
                for w in range(D):
                    dur = add(step, stage, w, "compute", jit(comp))
                    if stage == "advantage":  # buffer RPCs (plan), then the put
                        dur += add(step, stage, w, "plan", NODES * t["o_call"])
                        sec = NODES * t["o_obj"] + 0.9 * wb / D * t["b_local"]  # one object per node
                        dur += add(step, stage, w, "put", jit(sec), 0.9 * wb / D)
                    if stage == "old_log_prob":
                        sec = D * t["o_obj"] + 0.9 * wb / D * (t["b_local"] + 0.5 * B_NET)  # D pieces
                        dur += add(step, stage, w, "get", jit(sec), 0.9 * wb / D)
                    longest = max(longest, dur)
                now += longest
        else:
            now += add(step, "data", DRIVER, "load", 1e-6)
            sizes = [(0.01, 0.8), (0.8, 0.001), (0.8, 0.1), (0.9, 0.05), (0.95, 0.05), (1.0, 0.0)]
            for stage, (vin, vout) in zip(STAGES[1:], sizes):
                v, u = vin * wb, vout * wb
                now += add(step, stage, DRIVER, "split", jit(v * t["b_concat"]), v)
                now += add(step, stage, DRIVER, "dispatch", jit(D * t["o_obj"] + v * t["b_drv"]), v)  # D chunks
                now += D * t["o_call"]
                longest = 0.0
                for w in range(D):  # workers off the driver's node wait for the driver's link
                    per_byte = t["b_wrk"] / D + (0.5 * t["b_nic"] if nodes[w] != "n0" else 0.0)
                    dur = add(step, stage, w, "dispatch", jit(t["o_obj"] + v * per_byte), v / D)
                    dur += add(step, stage, w, "compute", jit(comp))
                    dur += add(step, stage, w, "collect", jit(t["o_obj"] + u * per_byte), u / D)
                    longest = max(longest, dur)
                now += longest
                now += add(step, stage, DRIVER, "collect", jit(D * t["o_obj"] + u * t["b_drv"]), u)
                now += add(step, stage, DRIVER, "concat", jit(u * t["b_concat"]), u)
        now += 0.05  # idle time between steps is not part of any step
    df = pd.DataFrame(rows, columns=SPAN_COLUMNS)
    df["seconds"] = df["end"] - df["start"]
    return df


@pytest.fixture(scope="module")
def fitted() -> sim.Calibration:
    spans = {m: fake_spans(m, seed=i) for i, m in enumerate(["distributed", "centralized"])}
    return sim.calibrate(spans, batch_rows=B, context=CTX, devices=D, label="fake run")


def test_calibrate_recovers_known_parameters(fitted):
    for name, true in TRUTH.items():
        assert getattr(fitted, name) == pytest.approx(true, rel=0.20), name
    assert fitted.beta == pytest.approx(40.0, rel=0.01)
    assert fitted.rho == pytest.approx(0.9, rel=0.01)
    assert fitted.passes_c == pytest.approx((0.01 + 0.8 + 0.8 + 0.001 + 0.8 + 0.1 + 0.9 + 0.05 + 0.95 + 0.05 + 1.0),
                                            rel=0.01)
    assert (fitted.redistributions, fitted.stages, fitted.batch_per_device) == (1, 7, 16)
    assert fitted.sources["b_local"].startswith("measured: spans of fake run")
    assert fitted.measured["nodes"] == NODES and fitted.measured["o_obj_fit_spans"] == 36
    assert set(fitted.describe().columns) == {"value", "unit", "source", "doc"}


def test_calibrated_model_reproduces_the_measured_steps(fitted):
    pred = sim.predict(fitted, [D], B, CTX, nodes=NODES).set_index("mode")
    for mode in ("distributed", "centralized"):
        assert pred.loc[mode, "step_s"] == pytest.approx(fitted.measured[f"{mode}_T"], rel=0.05), mode


def test_calibrate_with_one_mode_keeps_base_for_the_other(paper):
    base = dataclasses.replace(paper, o_obj=TRUTH["o_obj"], o_call=TRUTH["o_call"], b_net=B_NET)  # not fitted here
    cal = sim.calibrate({"distributed": fake_spans("distributed")}, B, CTX, D, base=base)
    assert cal.b_local == pytest.approx(TRUTH["b_local"], rel=0.2)
    assert cal.b_nic == paper.b_nic and cal.sources["b_nic"] == paper.sources["b_nic"]


# ---- the figure -------------------------------------------------------------------------
def test_scaling_plot_has_predicted_measured_and_paper_traces(paper):
    pred = pd.concat([sim.predict(paper, DEVICES, "proportional", L), sim.predict(paper, DEVICES, 16384, L)])
    measured = pd.DataFrame({"mode": ["distributed"] * 2 + ["centralized"] * 2, "workers": [2, 4, 2, 4],
                             "batch": [32, 64, 32, 64], "context": 1024, "throughput": [3.2e5, 6e5, 1.6e5, 2.2e5],
                             "data_plane_s": [0.02, 0.03, 0.1, 0.2], "data_plane_s_lo": [0.01, 0.02, 0.09, 0.15],
                             "data_plane_s_hi": [0.03, 0.04, 0.12, 0.25]})
    fig = sim.scaling_plot(pred, measured)
    names = [t.name for t in fig.data]
    assert any(n.startswith("predicted distributed (proportional") for n in names)
    assert any(n.startswith("predicted centralized (constant") for n in names)
    assert any(n.startswith("measured distributed") for n in names)
    assert sum(n.startswith("paper Fig. 9") for n in names) == 3 and any("Table 1" in n for n in names)
    dp = [t for t in fig.data if t.name.startswith("measured") and t.error_y.array is not None]
    assert dp and all(len(t.error_y.array) == 2 for t in dp)
    assert {t.line.dash for t in fig.data if t.name.startswith("predicted")} == {"dash", "dashdot"}
    assert not any(n.startswith("paper") for n in (t.name for t in sim.scaling_plot(pred, paper=False).data))
