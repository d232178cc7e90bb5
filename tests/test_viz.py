"""Figures and the HTML report, on spans built by hand (no Ray): the figures
must show exactly what the spans say."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from pydantic import BaseModel

from distflow_lab.observe.span_stats import stage_breakdown
from distflow_lab.graph.dag import DAG, Layout
from distflow_lab.dataplane.partition import constrained_lpt, karmarkar_karp, load_stats
from distflow_lab.graph.planner import plan as make_plan
from distflow_lab.observe.report import write_report
from distflow_lab.core.spans import DRIVER, Span, spans_to_frame
from distflow_lab.observe.figures import (PHASE_COLORS, ablation_figure, breakdown, cache_hits, cache_table, dag_figure,
                                      load_balance, load_balance_table, metric_curves, scaling_figure, timeline)
from distflow_lab.graph.drawing import dag_html, plan_html

STAGES = ["data", "rollout", "reward", "advantage", "old_log_prob", "ref_log_prob", "actor_update"]
GEN = {"data", "rollout", "reward", "advantage"}  # dp=2 tp=2; the rest dp=4: one redistribute edge
W = 4
NODE = {0: "n0", 1: "n0", 2: "n1", 3: "n1", DRIVER: "n0"}
T0 = 1_700_000_000.0


def _distributed() -> pd.DataFrame:
    """2 steps x 4 workers: cache hits on local edges, plan/put on advantage's
    writers, wait/get at old_log_prob, weight_sync nested in rollout's compute."""
    out, t = [], T0
    for step in range(2):
        for st in STAGES:
            comp = 0.02 + 0.01 * STAGES.index(st)
            for w in range(W):
                def sp(phase, a, b, **kw):
                    out.append(Span(step, st, w, NODE[w], phase, t + a, t + b, mode="distributed", **kw))
                c0 = 0.0
                if st == "old_log_prob":
                    sp("wait", 0.0, 0.002)
                    sp("get", 0.002, 0.006, bytes=2**20 * (w + 1), items=8, cache_hit=False)
                    c0 = 0.006
                elif st != "data":
                    sp("cache_hit", 0.0, 0.0005, items=8, cache_hit=True)
                    c0 = 0.0005
                c1 = c0 + comp + 0.001 * w
                sp("compute", c0, c1, items=8, tokens=800 + w)
                if st == "rollout":
                    sp("weight_sync", c0, c0 + 0.004)
                if st == "advantage" and w % 2 == 0:  # group rank 0 writes
                    sp("plan", c1, c1 + 0.001, items=16)
                    sp("put", c1 + 0.001, c1 + 0.005, bytes=2**21, items=16)
            t += comp + 0.02
    return spans_to_frame(out)


def _centralized() -> pd.DataFrame:
    """Driver load/split/dispatch/collect/concat; workers' dispatch (get chunk), compute, collect (put output)."""
    out, t = [], T0 + 100
    for step in range(2):
        for st in STAGES:
            def drv(phase, a, b, **kw):
                out.append(Span(step, st, DRIVER, "n0", phase, t + a, t + b, mode="centralized", **kw))
            if st == "data":
                drv("load", 0.0, 0.01, items=32, bytes=2**20)
                t += 0.02
                continue
            drv("split", 0.0, 0.001)
            drv("dispatch", 0.001, 0.011, bytes=4 * 2**20)
            for w in range(W):
                out.append(Span(step, st, w, NODE[w], "dispatch", t + 0.011, t + 0.013, bytes=2**20, items=8,
                                mode="centralized"))
                out.append(Span(step, st, w, NODE[w], "compute", t + 0.013, t + 0.04, items=8, tokens=800,
                                mode="centralized"))
                if st not in GEN or w % 2 == 0:
                    out.append(Span(step, st, w, NODE[w], "collect", t + 0.04, t + 0.042, bytes=2**19,
                                    mode="centralized"))
            drv("collect", 0.042, 0.05, bytes=2**21)
            drv("concat", 0.05, 0.052)
            t += 0.06
    return spans_to_frame(out)


@pytest.fixture(scope="module")
def dist() -> pd.DataFrame:
    return _distributed()


@pytest.fixture(scope="module")
def cent() -> pd.DataFrame:
    return _centralized()


def _fn(batch):
    return batch


@pytest.fixture(scope="module")
def plan():
    dag = DAG("grpo")
    gen = Layout(tp=2)
    prev = None
    for st in STAGES:
        deps = [] if prev is None else ["advantage"] if st in ("old_log_prob", "ref_log_prob") else [prev]
        if st == "actor_update":
            deps = ["old_log_prob", "ref_log_prob"]
        dag.node(st, _fn, deps=deps, layout=gen if st in GEN else Layout(),
                 type="data_load" if st == "data" else "compute", role="data" if st == "data" else "custom")
        prev = st
    return make_plan(dag, W)


# ---- timeline ------------------------------------------------------------------------------------

def test_timeline_one_trace_per_phase_one_bar_per_span(dist):
    fig = timeline(dist)
    assert {t.name for t in fig.data} == set(dist["phase"])
    assert len(fig.data) == dist["phase"].nunique()
    assert sum(len(t.x) for t in fig.data) == len(dist)
    for t in fig.data:
        assert t.marker.color == PHASE_COLORS[t.name] and t.orientation == "h"
    # every bar is labelled with its stage (plotly hides a label that would not fit at a readable size)
    for t in fig.data:
        part = dist[dist.phase == t.name]
        assert list(t.text) == part["stage"].tolist() and t.textposition == "inside"
        assert t.marker.line.width > 0  # an outline keeps back-to-back stages of one phase apart
    assert fig.layout.uniformtext.mode == "hide" and fig.layout.uniformtext.minsize >= 8
    # the weight_sync trace is drawn after compute and thinner
    names = [t.name for t in fig.data]
    ws = fig.data[names.index("weight_sync")]
    assert names.index("weight_sync") > names.index("compute") and ws.width < fig.data[names.index("compute")].width


def test_timeline_bar_geometry_matches_span(dist):
    fig = timeline(dist)
    put = dist[dist.phase == "put"]
    tr = next(t for t in fig.data if t.name == "put")
    t0 = dist["start"].min()
    np.testing.assert_allclose(np.asarray(tr.base, float), put["start"] - t0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(tr.x, float), put["seconds"], atol=1e-9)
    assert list(tr.y) == [f"w{w}" for w in put["worker"]]
    assert tr.customdata[0][1] == "advantage" and abs(tr.customdata[0][4] - 2.0) < 1e-9  # stage, MiB
    assert len([s for s in fig.layout.shapes if s.name == "batch-boundary"]) == 2


def test_timeline_driver_row_only_in_centralized(dist, cent):
    rows_d = list(timeline(dist).layout.yaxis.categoryarray)
    rows_c = list(timeline(cent).layout.yaxis.categoryarray)
    assert "driver" not in rows_d and rows_d == ["w0", "w1", "w2", "w3"]
    assert rows_c[0] == "driver" and rows_c[1:] == ["w0", "w1", "w2", "w3"]


def test_timeline_step_filter(dist):
    fig = timeline(dist, batches=[1])
    assert sum(len(t.x) for t in fig.data) == (dist.batch_id == 1).sum()
    assert min(min(t.base) for t in fig.data) == 0.0  # x restarts at the first shown span
    assert len(timeline(dist.iloc[:0]).data) == 0


# ---- breakdown and cache hits ------------------------------------------------------------------------

def test_breakdown_table_matches_analysis(dist, cent):
    fig, table = breakdown({"distributed": dist, "centralized": cent}, STAGES)
    assert table.index[-1] == "total" and list(table.index[:-1]) == STAGES
    for mode, df in (("distributed", dist), ("centralized", cent)):
        ref = stage_breakdown(df, STAGES)
        t = table[mode]
        phases = [c for c in t.columns if c != "total"]
        np.testing.assert_allclose(t["total"], t[phases].sum(axis=1))
        for p in ref.columns:
            np.testing.assert_allclose(t.loc[ref.index, p], ref[p], atol=1e-12)
        np.testing.assert_allclose(t.loc["total"], t.drop(index="total").sum())
    assert {"put", "get", "cache_hit", "wait", "plan"} <= set(table["distributed"].columns)
    assert {"split", "dispatch", "collect", "concat"} <= set(table["centralized"].columns)
    # legend: one entry per phase, stacks sum to the table's totals
    legend = {t.name for t in fig.data if t.type == "bar" and t.showlegend}
    assert legend == set(table.columns.get_level_values("phase")) - {"total"}
    bars = [t for t in fig.data if t.type == "bar" and t.showlegend]
    i = list(zip(*bars[0].x)).index(("advantage", "distributed"))
    assert sum(b.y[i] for b in bars) == pytest.approx(table.at["advantage", ("distributed", "total")])


def test_cache_hits(dist, cent):
    t = cache_table(dist).set_index("stage")
    assert t.at["old_log_prob", "hits"] == 0 and t.at["old_log_prob", "misses"] == W
    assert t.at["old_log_prob", "mib_in"] == pytest.approx(1 + 2 + 3 + 4)
    assert t.at["reward", "hits"] == W and t.at["reward", "misses"] == 0
    fig = cache_hits(dist)
    hits = next(tr for tr in fig.data if tr.name == "cache hit")
    assert list(hits.x) == t.index.tolist() and list(hits.y) == t["hits"].tolist()
    assert not [a for a in fig.layout.annotations if a.name == "no-bytes"]
    c = cache_table(cent).set_index("stage")  # driver dispatches are not counted as worker misses
    assert (c.drop(index="data")["misses"] == W).all() and (c["hits"] == 0).all()


def test_cache_hits_without_bytes_says_so(dist):
    """Every edge local: no MiB bar on an empty -1..1 axis, but a sentence saying why."""
    local = dist[~dist.phase.isin(["get", "wait", "put", "plan"])]
    fig = cache_hits(local)
    assert [t.name for t in fig.data] == ["cache hit", "miss (get / dispatch)"]  # no "MiB in" trace
    note = [a for a in fig.layout.annotations if a.name == "no-bytes"]
    assert len(note) == 1 and note[0].text == "no bytes moved: every edge was a local-cache hit"
    assert note[0].xref == "x2 domain" and tuple(fig.layout.yaxis2.range) == (0, 1)


# ---- load balance ---------------------------------------------------------------------------------

def test_load_balance_lower_bound_and_ratios():
    lengths = np.array([10, 9, 8, 7, 6, 5, 4, 40])
    fig = load_balance(lengths, 4)
    lb = next(s for s in fig.layout.shapes if s.name == "lower bound")
    assert lb.y0 == lb.y1 == max(lengths.mean() * len(lengths) / 4, lengths.max()) == 40
    assert len(fig.data) == 3 and all(len(t.y) == 4 for t in fig.data)
    lpt = load_stats(lengths, constrained_lpt(lengths, 4))
    assert list(fig.data[0].y) == lpt.loads and f"{lpt.ratio:.3f}" in fig.data[0].name

    rng = np.random.default_rng(0)
    big = np.maximum(1, rng.lognormal(6, 1, 512)).astype(int)
    table = load_balance_table(big, 8).set_index("policy")
    kk = load_stats(big, karmarkar_karp(big, 8))
    assert table.at["Karmarkar-Karp", "max_load"] == kk.max_load
    assert (table["ratio"] >= 1 - 1e-12).all()
    assert table.at["constrained LPT", "ratio"] <= table.at["no balancing", "ratio"]
    assert table.at["Karmarkar-Karp", "ratio"] <= table.at["no balancing", "ratio"]
    assert table.at["constrained LPT", "ratio"] < 1.01  # near-optimal on 64 items per worker


# ---- DAG ----------------------------------------------------------------------------------------

def test_dag_figure_arrows_and_redistribute(plan):
    fig = dag_figure(plan)
    deps = [a for a in fig.layout.annotations if (a.name or "").startswith("dep:")]
    assert len(deps) == len(plan.logical_edges) and all(a.showarrow for a in deps)
    chain = {a.name.split(":", 1)[1]: a for a in fig.layout.annotations if (a.name or "").startswith("chain:")}
    assert len(chain) == len(plan.edges)
    assert chain["advantage->old_log_prob"].arrowcolor != chain["reward->advantage"].arrowcolor
    labels = {a.name: a.text for a in fig.layout.annotations if (a.name or "").startswith("chain-label:")}
    assert "redistribute" in labels["chain-label:advantage->old_log_prob"]
    assert [e.kind for e in plan.edges].count("redistribute") == 1


def test_svg_reprs(plan):
    page = plan_html(plan)
    assert "<svg" in page and page.count("dfl-arrow-redistribute)") == 1
    for s in plan.stages:
        assert f">{s.id}</text>" in page
    dag = DAG("broken").node("a", _fn).node("b", _fn, deps=["a", "missing"]).node("c", _fn, deps=["c"])
    page = dag_html(dag)  # a DAG that does not validate still draws
    assert "<svg" in page and all(f">{n}</text>" in page for n in "abc")
    assert "<script" not in page


# ---- curves -------------------------------------------------------------------------------------

def _metrics(seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n = 12
    return pd.DataFrame({"update": range(n), "wall_s": 0.5 + rng.random(n), "reward/mean": rng.random(n),
                         "actor/kl": rng.random(n) / 10, "tokens": 4096})


def test_metric_curves_overlay():
    fig = metric_curves({"distributed": _metrics(0), "centralized": _metrics(1)})
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["reward/mean", "actor/kl", "tokens/s"]
    assert {t.name for t in fig.data} == {"distributed", "centralized"} and len(fig.data) == 6
    thr = next(t for t in fig.data if t.name == "distributed" and t.xaxis == "x3")
    np.testing.assert_allclose(thr.y, 4096 / _metrics(0)["wall_s"])
    smooth = metric_curves(_metrics(0), ["reward/mean"], smooth=3)
    assert len(smooth.data) == 2 and smooth.data[1].y[2] == pytest.approx(_metrics(0)["reward/mean"][:3].mean())
    with pytest.raises(KeyError, match="nope"):
        metric_curves(_metrics(0), ["nope"])


def test_ablation_and_scaling():
    rungs = ["O1 baseline", "O2 +local cache", "O3 +double buffer", "O4 +load balance", "O5 +distributed buffer"]
    df = pd.DataFrame([{"rung": r, "batch": b, "median": 2.0 - i * 0.1, "lo": 1.9 - i * 0.1, "hi": 2.2 - i * 0.1}
                       for b in (64, 128) for i, r in enumerate(rungs)]).sample(frac=1, random_state=0)
    fig = ablation_figure(df)
    assert [t.name for t in fig.data] == rungs
    o3 = fig.data[2]
    assert list(o3.x) == ["batch 64", "batch 128"]
    np.testing.assert_allclose(o3.error_y.array, [0.2, 0.2])
    np.testing.assert_allclose(o3.error_y.arrayminus, [0.1, 0.1])
    assert ablation_figure(df.assign(speedup=1.0), value="speedup").data[0].error_y.array is None
    meas = pd.DataFrame({"workers": [2, 4, 8] * 2, "throughput": [1, 2, 4, 1, 1.5, 2], "mode": ["d"] * 3 + ["c"] * 3})
    fig = scaling_figure(meas, predicted=meas.assign(throughput=meas.throughput * 1.1))
    assert [t.name for t in fig.data] == ["d", "c", "d (predicted)", "c (predicted)"]
    assert fig.data[2].line.dash == "dash"


# ---- report -------------------------------------------------------------------------------------

class _Algo(BaseModel):
    lr: float = 1e-6
    kl_coef: float = 0.001


class _Config(BaseModel):
    mode: str = "distributed"
    seed: int = 1234
    algo: _Algo = _Algo()


def test_report_is_standalone(tmp_path, dist, cent, plan):
    rng = np.random.default_rng(0)
    session = SimpleNamespace(
        spans=dist, metrics=_metrics(0).iloc[:2], plan=plan, mode="distributed", config=_Config(),
        dag=SimpleNamespace(name="grpo"),
        redistribution_lengths=lambda: {"advantage->old_log_prob": (rng.integers(10, 500, 32), 4)},
    )
    out = write_report(session, tmp_path / "r" / "report.html", extra_spans={"centralized": cent})
    text = out.read_text()
    for sid in ("fig-dag", "fig-timeline", "fig-breakdown", "fig-cache", "fig-balance", "fig-metrics"):
        assert f"id='{sid}'" in text
    assert "figure failed" not in text
    assert text.count("plotly.js v") == 1
    assert not re.search(r"<script[^>]+src=[\"']?https?:", text)
    assert "seed: 1234" in text and "kl_coef: 0.001" in text and "grpo" in text
    assert "centralized" in text  # the side-by-side breakdown
    # every table sits in a horizontally scrolling box: the wide metrics table never widens the page
    tables = re.findall(r"(.{0,40})<table", text)
    assert tables and all("<div class='table-scroll'>" in t for t in tables)
    assert ".table-scroll{overflow-x:auto" in text
    # no lengths: no balance section
    session.redistribution_lengths = lambda: {}
    text = write_report(session, tmp_path / "r2.html").read_text()
    assert "id='fig-balance'" not in text and "id='fig-timeline'" in text
    # before the first step: every section still there, saying there is nothing yet
    empty = SimpleNamespace(spans=spans_to_frame([]), metrics=pd.DataFrame(), plan=None, mode="centralized",
                            config=None)
    text = write_report(empty, tmp_path / "empty.html").read_text()
    assert "figure failed" not in text and "id='fig-metrics'" in text and "no metrics recorded" in text


def test_seed_curves_draw_the_mean_and_the_seeds_range():
    from distflow_lab.observe.curves import seed_curves

    def run(offset: float) -> pd.DataFrame:
        return pd.DataFrame({"update": range(4), "reward/mean": np.arange(4) * 0.1 + offset})

    fig = seed_curves({"none": [run(0.0), run(1.0)], "tis": [run(0.5)]}, ["reward/mean"])
    upper, lower, mean = fig.data[:3]
    assert np.allclose(mean.y, np.arange(4) * 0.1 + 0.5) and np.allclose(upper.y, np.arange(4) * 0.1 + 1.0)
    assert np.allclose(lower.y, np.arange(4) * 0.1) and lower.fill == "tonexty"
    assert [t.name for t in fig.data if t.showlegend] == ["none (2 seeds)", "tis (1 seeds)"]
    with pytest.raises(KeyError, match="nope"):
        seed_curves({"none": [run(0.0)]}, ["nope"])
