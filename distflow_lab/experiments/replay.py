"""What-if replay: a recorded run's item lengths and per-stage costs, replayed under
other choices (balance policy, data plane, worker count) without rerunning it.

    r = replay(s, balance=["none", "lpt", "kk"])      # a Session, or a run dir
    r.summary                                         # median predicted step seconds per choice
    r.table                                           # per choice and step
    acc = replay_accuracy()                           # record none, replay lpt/kk, run them for real

The model, per recorded step t:
  * per stage s a cost per rank of  a_s + b_s * tokens  (least squares over the recorded
    compute spans: seconds vs tokens per worker and step, both clipped at 0);
  * which items each data-parallel rank holds: the recorded `items()` (item id, tokens,
    dp rank per stage); under another policy the items entering each redistribute edge
    are re-routed with `dataplane.routing.assign` (the function every data plane uses),
    in the producers' global order, and keep their rank through the local edges after it;
    under another worker count every layout's dp scales with it (the first layout's items
    are re-split contiguously, as the loader shards);
  * compute(t) = per layout segment (stages between redistributions): the slowest rank's
    chain of stage costs (distributed, coordinator: no barrier between stages of a
    segment) or the sum over stages of the slowest rank (centralized: every stage is a
    driver round trip);
  * predicted(t) = compute_choice(t) + rest(t), rest = recorded wall - compute_recorded:
    the data plane and control of that step. Another data plane takes its rest from that
    mode's own recording (a Session keeps earlier modes' spans and metrics after `reopen`),
    else scales it by `experiments.sim`'s data-plane cost of the two modes; another worker
    count scales it by the sim's data plane at the two sizes.
With the recorded choices, predicted(t) equals the recorded wall exactly.
Schedules: `replay(s, schedule=["one_step_off", "async:k=2:partial", ...])` replays a sync run
on worker groups under other schedules (throughput, staleness): see `schedule_replay`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from distflow_lab.core.config import MODES, Balance
from distflow_lab.core.run_columns import read_saved
from distflow_lab.core.spans import DRIVER, NESTED_PHASES
from distflow_lab.dataplane.routing import assign



@dataclass
class Recording:
    """What a replay needs from a run."""

    items: pd.DataFrame  # batch_id, stage, stage_index, worker, dp_rank, item_id, tokens (the recorded mode)
    spans: pd.DataFrame  # every recorded mode's spans (mode column)
    walls: dict[str, pd.Series]  # mode -> wall seconds per step
    mode: str  # the mode `items` were recorded in
    world_size: int
    stages: list[str]  # in plan order
    dp: dict[str, int]  # stage -> data-parallel size
    redistribute: dict[str, str] = field(default_factory=dict)  # consumer stage -> producer stage
    balance: str = "none"
    cost: Any = None  # the routing's workload coefficients (a, b)
    minibatches: int = 1


def _wall_series(metrics: pd.DataFrame) -> pd.Series:
    if metrics is None or not len(metrics) or "wall_s" not in metrics:
        return pd.Series(dtype=float)
    return metrics.set_index("update")["wall_s"].astype(float)


def _from_session(s: Any) -> Recording:
    plan, world = s.plan, len(s.workers)
    # earlier modes (reopen) give their data plane and control; an earlier run of this mode is not this run
    others = {m: df for m, df in s.previous.items() if m != s.mode and df is not None and len(df)}
    spans = pd.concat([*others.values(), s.spans], ignore_index=True)
    walls = {m: _wall_series(df) for m, df in s.previous_metrics.items() if m in others}
    walls[s.mode] = _wall_series(s.metrics)
    redis = {plan.stages[e.dst].id: plan.stages[e.src].id for e in plan.edges if e.kind == "redistribute"}
    routing = s.controller.routing
    return Recording(s.items(), spans, walls, s.mode, world, [st.id for st in plan.stages],
                     {st.id: st.dp for st in plan.stages}, redis, Balance(s.config.switches.balance).value,
                     getattr(routing, "cost", None), getattr(routing, "minibatches", 1) or 1)


def _from_dir(d: Path, balance: str | None) -> Recording:
    spans = read_saved(d / "spans.parquet", "spans")
    metrics = read_saved(d / "metrics.parquet", "metrics") if (d / "metrics.parquet").exists() else None
    if not (d / "items.parquet").exists():
        raise FileNotFoundError(f"{d} has no items.parquet (runs written before item lineage cannot be replayed)")
    items = read_saved(d / "items.parquet", "items")
    mode = str(spans["mode"].mode().iloc[0]) if len(spans) else "distributed"
    order = items.drop_duplicates("stage").sort_values("stage_index")["stage"].tolist()
    dp = items.groupby("stage")["dp_rank"].nunique().to_dict()
    redis = {b: a for a, b in zip(order, order[1:]) if dp.get(a) != dp.get(b)}  # a layout change routes
    world = int(spans.loc[spans["worker"] != DRIVER, "worker"].nunique())
    walls = {mode: _wall_series(metrics) if metrics is not None else
             spans.groupby("batch_id")["end"].max() - spans.groupby("batch_id")["start"].min()}
    return Recording(items, spans, walls, mode, world, order, dp, redis, Balance(balance or Balance.LPT).value)


def load_recording(source: Any, balance: str | None = None) -> Recording:
    """A Recording from a Session (all its modes so far) or a run directory (spans.parquet,
    metrics.parquet, items.parquet; `balance`: the policy it ran with, default lpt, the sessions' default)."""
    if isinstance(source, Recording):
        return source
    if isinstance(source, (str, Path)):
        return _from_dir(Path(source), balance)
    return _from_session(source)


# ---- costs -------------------------------------------------------------------------------------

def fit_costs(spans: pd.DataFrame) -> pd.DataFrame:
    """Per stage: seconds = a + b * tokens, least squares over (mode, step, worker) compute
    spans (nested weight_sync taken out); a, b clipped at 0 (refit through the origin, or
    the mean, when one would be negative). Columns: a_s, b_s_per_token, n, r2."""
    w = spans[(spans["worker"] != DRIVER) & spans["phase"].isin(["compute", *NESTED_PHASES])]
    rows = []
    keys = ["mode", "batch_id", "stage", "worker"]
    per = w.assign(sec=np.where(w["phase"] == "compute", w["seconds"], -w["seconds"]),
                   tok=np.where(w["phase"] == "compute", w["tokens"], 0)).groupby(keys)[["sec", "tok"]].sum()
    for stage, g in per.groupby(level="stage"):
        x, y = g["tok"].to_numpy(float), g["sec"].to_numpy(float)
        a, b = 0.0, 0.0
        if len(x) >= 2 and np.ptp(x) > 0:
            b, a = np.polyfit(x, y, 1)
        if b < 0 or len(x) < 2 or np.ptp(x) == 0:
            b, a = 0.0, float(y.mean())
        if a < 0:
            a, b = 0.0, float((x * y).sum() / max((x * x).sum(), 1e-12))
        pred = a + b * x
        ss = float(((y - y.mean()) ** 2).sum())
        rows.append({"stage": stage, "a_s": float(a), "b_s_per_token": float(b), "n": len(x),
                     "r2": 1 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else float("nan")})
    return pd.DataFrame(rows).set_index("stage") if rows else pd.DataFrame(columns=["a_s", "b_s_per_token", "n", "r2"])


# ---- the model -----------------------------------------------------------------------------------

def _segments(rec: Recording) -> list[list[str]]:
    segs: list[list[str]] = [[]]
    for st in rec.stages:
        if st in rec.redistribute and segs[-1]:
            segs.append([])
        segs[-1].append(st)
    return segs


def rank_tokens(rec: Recording, step_items: pd.DataFrame, policy: str | None, world: int) -> dict[str, np.ndarray]:
    """Tokens per data-parallel rank for each stage of one step under `policy` (None: as
    recorded) and `world` workers."""
    by_stage = {st: g for st, g in step_items.groupby("stage", sort=False)}
    same_world = world == rec.world_size
    as_recorded = same_world and (policy is None or Balance(policy).value == rec.balance)
    out: dict[str, np.ndarray] = {}
    for seg_i, seg in enumerate(_segments(rec)):
        rank_of: dict[int, int] | None = None  # item id -> rank, after this segment's redistribution
        for st in seg:
            g = by_stage.get(st)
            if g is None or not len(g):
                continue
            dp = max(1, round(rec.dp.get(st, 1) * world / rec.world_size))
            if (seg_i == 0 and same_world) or (seg_i > 0 and as_recorded):
                ranks = g["dp_rank"].to_numpy(np.int64)
            elif seg_i == 0:  # another worker count: the loader's contiguous shards of the global order
                pos = np.empty(len(g), np.int64)
                pos[np.argsort(g["dp_rank"].to_numpy(), kind="stable")] = np.arange(len(g))
                ranks = pos * dp // len(g)
            else:
                if rank_of is None:  # re-route the producer's outputs, in global order, as the data plane does
                    src = by_stage.get(rec.redistribute.get(seg[0], ""))
                    src = g if src is None or not len(src) else src
                    src = src.iloc[np.argsort(src["dp_rank"].to_numpy(), kind="stable")]
                    parts = assign(src["tokens"].to_numpy(np.int64), dp, policy or rec.balance,
                                   cost=rec.cost, minibatches=rec.minibatches)
                    ids = src["item_id"].to_numpy()
                    rank_of = {int(ids[i]): r for r, p in enumerate(parts) for i in p}
                ranks = np.array([rank_of.get(int(i), 0) for i in g["item_id"]], np.int64)
            out[st] = np.bincount(ranks, weights=g["tokens"].to_numpy(float), minlength=dp)
    return out


def compute_model(rec: Recording, tokens: dict[str, np.ndarray], costs: pd.DataFrame, mode: str) -> float:
    """Seconds of compute on the critical path of one step (see the module docstring)."""
    total = 0.0
    for seg in _segments(rec):
        per = [(costs.at[st, "a_s"] + costs.at[st, "b_s_per_token"] * tokens[st]) for st in seg
               if st in tokens and st in costs.index]
        if not per:
            continue
        if mode == "centralized":
            total += float(sum(p.max() for p in per))
        else:
            width = max(len(p) for p in per)
            chain = np.zeros(width)
            for p in per:  # same layout within a segment: the same number of ranks
                chain[:len(p)] += p
            total += float(chain.max())
    return total


def _sim_data_plane(mode: str, world: int, batch: int, context: int, calibration=None) -> float:
    from distflow_lab.experiments.sim import Calibration, predict

    cal = calibration or Calibration()
    return float(predict(cal, [world], batch=batch, context=context, mode=mode, nodes=1)["data_plane_s"].iloc[0])


def _rest_by_mode(rec: Recording, costs: pd.DataFrame) -> dict[str, pd.Series]:
    """Per recorded mode and step: wall - compute model (its own recorded token loads)."""
    out = {}
    for mode, walls in rec.walls.items():
        sp = rec.spans[(rec.spans["mode"] == mode) & (rec.spans["worker"] != DRIVER) & (rec.spans["phase"] == "compute")]
        rest = {}
        for step, g in sp.groupby("batch_id"):
            if step not in walls.index:
                continue
            if mode == rec.mode:
                tok = rank_tokens(rec, rec.items[rec.items["batch_id"] == step], None, rec.world_size)
            else:  # from the spans: a rank's tokens = its first worker's compute tokens
                tok = {}
                for st, gs in g.groupby("stage"):
                    gsize = max(1, rec.world_size // rec.dp.get(st, rec.world_size))
                    per_w = gs.groupby("worker")["tokens"].sum()
                    per_w = per_w[per_w.index % gsize == 0]
                    tok[st] = per_w.to_numpy(float)
            rest[step] = float(walls[step]) - compute_model(rec, tok, costs, mode)
        out[mode] = pd.Series(rest, dtype=float)
    return out


@dataclass
class Replay:
    """Predicted step seconds per choice (`table`: per step; `summary`: per choice)."""

    table: pd.DataFrame
    costs: pd.DataFrame
    recorded: dict

    @property
    def summary(self) -> pd.DataFrame:
        keys = ["balance", "mode", "world_size"]
        g = self.table.groupby(keys, sort=False)
        out = g.agg(predicted_s=("predicted_s", "median"), compute_s=("compute_s", "median"),
                    rest_s=("rest_s", "median"), recorded_s=("recorded_s", "median"), steps=("batch_id", "nunique"))
        out["vs_recorded"] = out["predicted_s"] / out["recorded_s"] - 1
        return out.reset_index()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.summary.round(4))

    def __repr__(self) -> str:
        return (f"Replay of a {self.recorded['mode']} run (balance={self.recorded['balance']}, "
                f"world_size={self.recorded['world_size']}): median step seconds\n"
                f"{self.summary.round(4).to_string(index=False)}")


def _as_list(x: Any, default: Any) -> list:
    if x is None:
        return [default]
    return [x] if isinstance(x, (str, int, Balance)) else list(x)


def replay(source: Any, balance: str | Iterable[str] | None = None, mode: str | Iterable[str] | None = None,
           world_size: int | Iterable[int] | None = None, *, steps: Iterable[int] | None = None,
           calibration=None, recorded_balance: str | None = None, schedule: Any = None,
           **schedule_options: Any):
    """Predicted step times of a recorded run (a Session or a run directory) under other
    choices; each choice is a value or a list (every combination is replayed; None: as
    recorded). `steps`: which recorded steps (default all with items); `calibration`: an
    `experiments.sim.Calibration` for modes or sizes without a recording of their own;
    `recorded_balance`: the policy a run directory ran with (a Session knows).

    `schedule`: a schedule or a list ("sync", "one_step_off", "async:k=2:partial", or
    ("async", {"max_staleness": 2, "partial_rollout": True})): replays a sync run under each
    (`schedule_replay.replay_schedules`, which takes `schedule_options`: updates, skip, knobs,
    rollout, train_from) and returns a ScheduleReplay."""
    if schedule is not None:
        from distflow_lab.experiments.schedule_replay import replay_schedules

        mixed = [k for k, v in dict(balance=balance, mode=mode, world_size=world_size, steps=steps,
                                    calibration=calibration).items() if v is not None]
        if mixed:
            raise ValueError(f"replay(schedule=...) replays schedules only; it does not take {mixed} as well")
        return replay_schedules(source, schedule, **schedule_options)
    if schedule_options:
        raise TypeError(f"replay() got unexpected keyword arguments {sorted(schedule_options)} "
                        f"(they go with schedule=...)")
    rec = load_recording(source, recorded_balance)
    if not len(rec.items):
        raise ValueError("no recorded items to replay: run a step first")
    costs = fit_costs(rec.spans)
    rest = _rest_by_mode(rec, costs)
    wanted = sorted(rec.items["batch_id"].unique()) if steps is None else [int(s) for s in steps]
    items_by_step = {s: g for s, g in rec.items.groupby("batch_id")}
    batch = int(rec.items[rec.items["stage"] == rec.stages[-1]].groupby("batch_id").size().median())
    context = int(rec.items[rec.items["stage"] == rec.stages[-1]]["tokens"].max())
    rows = []
    for pol, m, k in itertools.product(_as_list(balance, rec.balance), _as_list(mode, rec.mode),
                                       _as_list(world_size, rec.world_size)):
        pol, k = Balance(pol).value, int(k)
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; modes: {MODES}")
        source_mode = m if m in rest and len(rest[m]) else rec.mode
        scale = 1.0
        if source_mode != m or k != rec.world_size:
            scale = _sim_data_plane(m, k, batch, context, calibration) / _sim_data_plane(
                source_mode, rec.world_size, batch, context, calibration)
        for step in wanted:
            if step not in items_by_step:
                continue
            tok = rank_tokens(rec, items_by_step[step], pol, k)
            comp = compute_model(rec, tok, costs, m)
            r = rest[source_mode]
            base = float(r[step]) if step in r.index else float(r.median())
            recorded = rec.walls.get(rec.mode, pd.Series(dtype=float)).get(step, np.nan)
            rows.append({"balance": pol, "mode": m, "world_size": k, "batch_id": int(step), "predicted_s": comp + base * scale,
                         "compute_s": comp, "rest_s": base * scale, "recorded_s": float(recorded),
                         "rest_from": source_mode if scale == 1.0 else f"{source_mode} x sim {scale:.3g}"})
    return Replay(pd.DataFrame(rows), costs, {"mode": rec.mode, "balance": rec.balance, "world_size": rec.world_size})


# ---- accuracy against real runs ---------------------------------------------------------------------

@dataclass
class Accuracy:
    """Replay vs real runs of the same choices: `table` per (policy, step); `median_abs_error`."""

    table: pd.DataFrame
    base: str
    replayed: Replay
    recording: Recording

    @property
    def median_abs_error(self) -> float:
        return float(self.table["abs_error"].median())

    @property
    def by_policy(self) -> pd.DataFrame:
        return self.table.groupby("balance").agg(predicted_s=("predicted_s", "median"),
                                                 measured_s=("measured_s", "median"),
                                                 median_abs_error=("abs_error", "median")).reset_index()

    def __repr__(self) -> str:
        return (f"replay of a balance={self.base} run vs real runs: median |error| "
                f"{self.median_abs_error:.1%}\n{self.by_policy.round(4).to_string(index=False)}")


def replay_accuracy(policies: Iterable[str] = ("lpt", "kk"), base: str = "none", steps: int = 6, skip: int = 1,
                    mode: str = "distributed", dag=None, world_size: int = 4, session=None,
                    progress: bool = False, schedules: Iterable[Any] | None = None):
    """Record `steps` steps with balance=`base`, replay them under `policies`, run each policy
    for real (same seed: the same items), and compare step by step (the first `skip` steps
    are warm-up and left out). `dag`: default a synthetic GRPO with simulated compute
    (us_per_token) and a long-tailed response length, where balance matters. Reuses
    `session` (reopened) when given, else opens and closes one.

    `schedules` (e.g. ["one_step_off", "async:k=2"]): checks the schedule replay instead
    (`schedule_replay.schedule_replay_accuracy`: a sync recording on worker groups, `steps`
    measured updates after `skip` warm-up ones; `dag` default: the async bench's long-tail DAG)."""
    if schedules is not None:
        from distflow_lab.experiments.schedule_replay import schedule_replay_accuracy

        return schedule_replay_accuracy(schedules, steps=steps, warmup=skip, dag=dag, workers=world_size, mode=mode,
                                        session=session)
    from distflow_lab.api.session import Session
    from distflow_lab.experiments.synthetic import synthetic_grpo

    dag = dag or synthetic_grpo(batch_size=8, n=4, max_prompt_len=64, max_response_len=256, rollout_tp=2,
                                us_per_token=40.0, response_len_sigma=1.0)
    own = session is None
    s = session or Session(dag, world_size=world_size, mode=mode, balance=base)
    try:
        if not own:
            s.reopen(mode=mode, dag=dag, balance=base)
        s.run(steps, progress=progress)
        rec = load_recording(s)
        kept = [t for t in sorted(rec.items["batch_id"].unique()) if t >= skip]
        predicted = replay(rec, balance=list(policies), steps=kept)
        rows = []
        for pol in policies:
            s.reopen(mode=mode, dag=dag, balance=pol)
            measured = s.run(steps, progress=progress).set_index("update")["wall_s"]
            p = predicted.table[predicted.table["balance"] == Balance(pol).value].set_index("batch_id")
            for t in kept:
                rows.append({"balance": Balance(pol).value, "batch_id": t, "recorded_s": float(p.at[t, "recorded_s"]),
                             "predicted_s": float(p.at[t, "predicted_s"]), "measured_s": float(measured[t])})
    finally:
        if own:
            s.close()
    table = pd.DataFrame(rows)
    table["error"] = table["predicted_s"] / table["measured_s"] - 1
    table["abs_error"] = table["error"].abs()
    return Accuracy(table, base, predicted, rec)
