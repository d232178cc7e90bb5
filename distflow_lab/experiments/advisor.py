"""Which schedule to run: candidate configurations ranked by the schedule replay's predictions.

    a = lab.advise(s, max_staleness=2)          # a Session that ran sync on worker groups (or a run dir)
    a.table                                     # one row per candidate, best first
    a.figure()                                  # predicted tokens/s against staleness
    a = lab.advise(s, verify=2)                 # and run the top two for real: a.regret
    a = lab.advise(s, micro_token_budgets=[256, 1024, 4096], calibrate=6)   # micro-batch sizes too

Candidates: every schedule in SCHEDULES whose staleness bound is at most `max_staleness`
(async at k = 1..max_staleness, with and without partial rollouts), on every split of the
workers between generation and training (`budget`, default the recording's). Each is the
schedule replay (experiments/schedule_replay.py: the real `Lanes` in simulated time) of the
recording with its lanes rescaled to the split:

    generation seconds x (recorded rollout workers / candidate rollout workers),
    training seconds   x (recorded training workers / candidate training workers)

(data parallel: each worker's share of the batch; the driver's gap unchanged). That is the
model's weakest part: it assumes no fixed cost per worker and no change in contention, so
`verify` runs the best candidates for real and reports the regret (how much slower the
predicted best ran than the best of those run).

Micro-batch sizes (`micro_token_budgets`, a session opened from a run config: its
actor.micro_token_budget): each training rank's rows are packed again to the candidate budget
as the engine packs them (models/fsdp.pack_rows) and the batch's training seconds move by
the fitted cost of the new packing (`schedule_replay.TrainFit`: padded tokens, and a cost per
micro-batch, which a recording at one budget cannot show: `calibrate=n` first runs n sync
updates at the smallest candidate budget, `schedule_replay.calibrate_micro`). What a smaller
budget buys on a GPU, memory, is not modelled: the ranking is by throughput only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd

from distflow_lab.core.config import SCHEDULES
from distflow_lab.experiments.schedule_replay import (LaneRecording, ScheduleSpec, calibrate_lanes, calibrate_micro,
                                                      load_lanes, parse_schedule, replay_schedules, with_micro_budget)


def candidate_schedules(max_staleness: int) -> list[ScheduleSpec]:
    """Every schedule within `max_staleness`: the fixed ones, and the others at each k, with and
    without partial rollouts (from SCHEDULES' facts)."""
    out = []
    for name, facts in SCHEDULES.items():
        if facts.staleness is not None:
            if facts.staleness <= max_staleness:
                out.append(parse_schedule(name))
            continue
        for k in range(1, max_staleness + 1):
            for partial in ((False, True) if facts.partial_rollout else (False,)):
                out.append(parse_schedule((name, {"max_staleness": k, "partial_rollout": partial})))
    return out


def rescale(rec: LaneRecording, split: tuple[int, int], recorded: tuple[int, int]) -> LaneRecording:
    """The recording's lanes on another (generation, training) split (see the module docstring)."""
    g, t = recorded[0] / split[0], recorded[1] / split[1]
    if (g, t) == (1.0, 1.0):
        return rec
    b = rec.batches.copy()
    b[["gen_s", "rollout_s"]] *= g
    b["train_s"] *= t
    return replace(rec, batches=b, train_fit=rec.train_fit.scaled(t), decode_s=rec.decode_s * g,
                   notes=[*rec.notes, f"rescaled from {recorded[0]}+{recorded[1]} to {split[0]}+{split[1]} workers "
                                      f"(generation x{g:.2f}, training x{t:.2f})"])


@dataclass
class Advice:
    """Candidates best first (`table`), with `verify` the real runs of the top ones, and what the
    replay's cost model assumed or measured (`notes`, the recording's)."""

    table: pd.DataFrame
    verified: pd.DataFrame | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> dict:
        return self.table.iloc[0].to_dict()

    @property
    def regret(self) -> float | None:
        """1 - real tokens/s of the predicted best / the best real tokens/s among those verified."""
        if self.verified is None or not len(self.verified):
            return None
        real = self.verified["real_tokens_per_s"]
        return float(1 - real.iloc[0] / real.max())

    def figure(self):
        import plotly.express as px

        t = self.table.assign(split=self.table["rollout_workers"].astype(str) + "+" +
                              self.table["train_workers"].astype(str) +
                              self.table["micro_token_budget"].map(lambda b: f" mtb {int(b)}" if pd.notna(b) else ""))
        fig = px.scatter(t, x="staleness_mean", y="tokens_per_s", color="schedule", symbol="split",
                         hover_data=["step_s", "trainer_idle", "rollout_idle"],
                         title="advise: predicted throughput against staleness (up and left is better)")
        if self.verified is not None:
            fig.add_scatter(x=self.verified["real_staleness_mean"], y=self.verified["real_tokens_per_s"],
                            mode="markers", marker=dict(symbol="x", size=12, color="black"), name="real (verify)")
        return fig

    def __repr__(self) -> str:
        cols = ["rank", "schedule", "rollout_workers", "train_workers", "micro_token_budget", "tokens_per_s",
                "staleness_mean", "step_s", "same_as"]
        cols = [c for c in cols if c != "micro_token_budget" or self.table[c].notna().any()]  # none: not a knob here
        out = f"advise: {len(self.table)} candidates, best first\n{self.table[cols].head(10).round(3).to_string(index=False)}"
        if self.verified is not None:
            out += (f"\nverified (real runs): regret {self.regret:.1%}\n"
                    f"{self.verified.round(3).to_string(index=False)}")
        return out + "".join(f"\n  note: {n}" for n in self.notes)

    def _repr_html_(self) -> str:
        return f"<pre>{self!r}</pre>"


def advise(source: Any, *, max_staleness: int = 2, budget: int | None = None,
           splits: list[tuple[int, int]] | None = None, recorded: tuple[int, int] | None = None, verify: int = 0,
           updates: int | None = None, skip: int = 1, knobs: Any = None, calibrate: int = 0,
           micro_token_budgets: list[int] | None = None) -> Advice:
    """Rank every candidate (schedule, k, partial rollouts, worker split, micro-batch budget) by
    predicted trained tokens/s (ties: lower staleness) from a recorded sync run on worker groups.
    `budget`: the worker budget to split (default the recording's); `splits`: the (generation,
    training) splits to try (default every one); `recorded`: the recording's split (a Session
    knows); `micro_token_budgets`: the actor.micro_token_budget values to try (default the
    recording's only); `knobs`: the replay's (schedule_replay.Knobs); `calibrate=n` (a Session):
    n updates of one_step_off and of async k=1 with partial rollouts measure the lanes'
    contention and the streaming engine's decode cost first (`schedule_replay.calibrate_lanes`),
    and with other micro budgets, n sync updates at the smallest the cost of a micro-batch
    (`schedule_replay.calibrate_micro`). `verify=n` (a Session only) runs the top n for real on
    it (reopened: same seed) for as many updates as the replay and reports them and the regret;
    a candidate the replay runs update for update as an earlier one (`same_as`: async k=1 paces
    as one_step_off) is ranked but not run again."""
    rec = load_lanes(source, skip=skip, knobs=knobs)
    recorded = recorded or _recorded_split(source)
    budgets = _micro_budgets(micro_token_budgets, rec)
    if calibrate:
        if len(budgets) > 1 and not rec.train_fit.micro_known:
            rec = calibrate_micro(source, rec, min(b for b in budgets if b != rec.micro_token_budget), calibrate,
                                  min(skip, calibrate - 1))
        rec = calibrate_lanes(source, rec, calibrate, min(skip, calibrate - 1))
    total = budget or sum(recorded)
    if total < 2:
        raise ValueError(f"advise: budget={total} workers cannot be split into a generation and a training group")
    splits = splits or [(g, total - g) for g in range(1, total)]
    bad = [sp for sp in splits if len(sp) != 2 or min(sp) < 1]
    if bad:
        raise ValueError(f"advise: splits must be (generation workers, training workers), each >= 1; got {bad}")
    rows = []
    for mtb in budgets:
        at_mtb = with_micro_budget(rec, mtb)  # the recording itself at its own budget
        for split in splits:
            r = replay_schedules(rescale(at_mtb, split, recorded), candidate_schedules(max_staleness),
                                 updates=updates, skip=skip)
            runs = _same_runs(r.table)
            for row in r.summary.to_dict("records"):
                rows.append({"schedule": row["schedule"], "rollout_workers": split[0], "train_workers": split[1],
                             "micro_token_budget": mtb,
                             **{k: row[k] for k in ("tokens_per_s", "staleness_mean", "step_s", "trainer_idle",
                                                    "rollout_idle", "dropped_batches")},
                             "same_as": runs.get(row["schedule"], ""), "options": row["options"]})
    table = pd.DataFrame(rows).sort_values(["tokens_per_s", "staleness_mean"], ascending=[False, True],
                                           ignore_index=True, kind="stable")
    table.insert(0, "rank", range(1, len(table) + 1))
    advice = Advice(table, notes=rec.notes)
    if verify:
        if not hasattr(source, "reopen"):
            raise ValueError("advise(verify=...) runs candidates for real: pass the Session, not a run dir")
        distinct = table[table["same_as"] == ""]
        advice.verified = _verify(source, distinct.head(verify), recorded, updates or len(rec.batches), skip,
                                  rec.micro_token_budget)
    return advice


def _micro_budgets(given: list[int] | None, rec: LaneRecording) -> list[int | None]:
    """The micro_token_budget candidates: `given` (checked), else the recording's."""
    if not given:
        return [rec.micro_token_budget]
    bad = [b for b in given if not isinstance(b, int) or b < 1]
    if bad:
        raise ValueError(f"advise: micro_token_budgets must be token counts >= 1; got {bad}")
    if rec.micro_token_budget is None:
        raise ValueError("advise: micro_token_budgets need a session opened from a run config (its training engine "
                         "packs micro-batches); this recording's training has none (e.g. the synthetic DAG)")
    return sorted(set(given))


def _same_runs(table: pd.DataFrame) -> dict[str, str]:
    """Schedule -> the first schedule whose replayed run is the same update for update (same batch,
    staleness and times): e.g. async k=1 without partial rollouts paces exactly as one_step_off.
    Verifying both would spend a real run on a question the replay cannot tell apart."""
    seen, same = {}, {}
    for name, t in table.groupby("schedule", sort=False):
        key = tuple(t[["batch", "staleness", "wall_s", "end_s"]].round(9).itertuples(index=False, name=None))
        if key in seen:
            same[name] = seen[key]
        else:
            seen[key] = name
    return same


def _recorded_split(source: Any) -> tuple[int, int]:
    plan = getattr(source, "plan", None)
    if plan is None or len(plan.groups) != 2:
        raise ValueError("advise needs a Session that ran sync on two worker groups (generation, training), or a "
                         "run dir with recorded=(generation workers, training workers): it rescales their lanes")
    return plan.groups[0][2], plan.groups[1][2]


def _verify(s: Any, top: pd.DataFrame, recorded: tuple[int, int], updates: int, skip: int,
            recorded_mtb: int | None) -> pd.DataFrame:
    """Run each of `top` for real on the session (reopened; another split: the DAG regrouped;
    another micro budget: the engines rebuilt with it)."""
    from distflow_lab.experiments.schedule_replay import measure

    names = [g[0] for g in s.plan.groups]
    dag, rows = s.dag, []
    for row in top.to_dict("records"):
        split = (row["rollout_workers"], row["train_workers"])
        regrouped = dag if split == recorded else dag.copy().with_groups(**dict(zip(names, split)))
        mtb = row["micro_token_budget"]
        real = measure(s, row["options"], updates, skip, dag=regrouped,
                       overrides=[f"actor.micro_token_budget={mtb}"] if mtb is not None else None)
        rows.append({"rank": row["rank"], "schedule": row["schedule"], "rollout_workers": split[0],
                     "train_workers": split[1], "micro_token_budget": mtb, "predicted_tokens_per_s": row["tokens_per_s"],
                     "real_tokens_per_s": real["tokens_per_s"],
                     "error": row["tokens_per_s"] / real["tokens_per_s"] - 1,
                     "real_staleness_mean": float((real["dist"].index.to_numpy(float) * real["dist"].to_numpy()).sum())})
    s.reopen(dag=dag, schedule="sync",  # as it was
             **({"overrides": [f"actor.micro_token_budget={recorded_mtb}"]} if recorded_mtb is not None else {}))
    return pd.DataFrame(rows)
