"""What-if for schedules: from one recorded sync run on worker groups, the throughput and
the staleness distribution of one_step_off and async k (with and without partial
rollouts), by running the scheduler itself, `runtime/schedule_lanes.Lanes`, in simulated time
(experiments/sim_dispatch.py) over cost models fitted from the recording. The pacing rules
(what may run ahead, which batch trains, what is too stale) exist once, in Lanes; this
module holds only the cost models and the summaries.

    r = lab.replay(s, schedule=["sync", "one_step_off", "async:k=2", "async:k=2:partial"])
    r.summary                                   # one row per schedule
    acc = lab.schedule_replay_accuracy()        # record sync, replay, run each for real

What the recording gives, per batch r (= step = update under sync):
  G_r  the generation lane's seconds (its share of the wall the rollout group was busy:
       (1 - schedule/rollout_idle) * wall: the pull of the newest policy, data, rollout,
       reward, advantage, the calls' own latency);
  T_r  the training lane's seconds ((1 - schedule/trainer_idle) * wall: the training
       stages and the publish of the policy);
  c_r  = wall_r - G_r - T_r: the driver between lanes (end of step in the data plane,
       launches), paid on the trainer's path;
  the trained tokens, rows and padded tokens (rows x the longest) of batch r, and per
  rollout rank the response lengths.
  A colocated recording (no groups) has no lanes: G and T are then the stages' critical
  paths from the spans (generation: the stages before the first actor/reference/critic
  stage), and the replay assumes each group would keep those per-stage times.

The cost models (`SegmentCosts`):
  generation of batch r takes G_r, less the recorded policy pull when it runs ahead at the
  version it already holds (a worker loads only a newer version);
  training of batch r takes T_r and publishes at its end, then the driver's c_r;
  contention: while both lanes run, each runs f times slower (the groups share the
  machine's cores; Knobs.contention may give each lane its own f); fitted by `calibrate_lanes` from a few
  one_step_off updates the accuracy check runs itself, or Knobs.contention; 1.0 otherwise;
  warm-up: a reopened session on a real engine builds it again and pays its first updates'
  warm-up again, the synthetic DAG does not (Knobs.rewarm).
Without partial rollouts a batch's samples all carry the version of the generation's start.

Partial rollouts: the rollout runs `synthetic.StreamingDecoder`'s rules in simulated time on
each rollout rank: `slots = slots_per_row * rows` sequences decode together, one decode
iteration (d seconds) gives every active sequence a token stamped with the version held;
a call returns when whole prompts with `rows` answers have finished, in the order they
completed (a real engine's prompt: its rollout.n answers, Knobs.group_size; the synthetic
decoder's: one), the rest carry into the next call;
between calls the synthetic decoder keeps decoding with the last version (no admission),
a real engine does not (Knobs.between_calls); every `refresh_every` iterations the newest
published version is pulled; sequences older than k versions at the update they would
train at are restarted, or dropped with every started answer of their prompt. d and the
prompt length p come from the sync recording: p counted per batch (mean item tokens less the
logged `response_length/mean`; where none is logged, fitted as below), and d from the static
batch waiting for its longest response: rollout seconds = d * (max item tokens - p) per rank
and step (least squares). The response lengths are the recorded ones, in
recorded order per rank (a partial run draws its own: same distribution, not the same
draws), cycled past the recording. A partial batch holds other sequences than the sync
batch, usually shorter ones (the long tail carries over, and ages out): T = a + b * padded
tokens (a real engine's batch pads to its longest row; + c * micro-batches) or trained tokens
(the synthetic DAG), whichever fits better (least squares, terms >= 0) over the recorded steps
and the partial updates `calibrate_lanes` runs (shorter rows than any sync batch), and the
rest of the generation lane (G_r - rollout_r) as recorded. Refresh pulls cost nothing here
(about a millisecond each on the bench).

Staleness of a trained sample: update - its oldest token's version (what the trainer's
bound checks, and what `items()` reports as `version`); per token with partial rollouts:
update - the version that decoded it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pandas as pd
from pydantic import ValidationError

from distflow_lab.core.config import SCHEDULES, ScheduleOptions
from distflow_lab.core.errors import ConfigError
from distflow_lab.core.run_columns import read_saved
from distflow_lab.core.spans import DRIVER, NESTED_PHASES
from distflow_lab.models.stream_slots import top_up

# ---- schedules ---------------------------------------------------------------------------------

_SHORT = {"k": "max_staleness", "partial": "partial_rollout", "on_stale": "on_stale"}
TRAIN_ROLES = ("actor", "reference", "critic", "values")  # colocated: training starts at the first of these


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule to replay (validated by the session's own `ScheduleOptions`)."""

    schedule: ScheduleOptions

    @property
    def kind(self) -> str:
        return self.schedule.kind

    @property
    def k(self) -> int:
        return self.schedule.staleness

    @property
    def partial(self) -> bool:
        return self.schedule.partial_rollout

    @property
    def on_stale(self) -> str:
        return self.schedule.on_stale

    @property
    def name(self) -> str:
        if not SCHEDULES[self.kind].partial_rollout:  # no options of its own
            return self.kind
        return f"{self.kind} k={self.k}" + (" + partial" if self.partial else "") + (
            f" ({self.on_stale})" if self.on_stale != "drop" else "")

    @property
    def options(self) -> dict:
        """For `Session.reopen(schedule=..., **options)`."""
        o = self.schedule
        if not SCHEDULES[self.kind].partial_rollout:
            return {"schedule": o.kind}
        return {"schedule": o.kind, "max_staleness": o.max_staleness, "partial_rollout": o.partial_rollout,
                "on_stale": o.on_stale}


def _from_string(text: str) -> tuple[str, dict]:
    """"async:k=2:partial" -> ("async", {"max_staleness": 2, "partial_rollout": True})."""
    kind, *parts = text.strip().split(":")
    opts: dict[str, Any] = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if key not in _SHORT:
            raise ConfigError(f"schedule {text!r}: unknown key {key!r}; keys: {sorted(_SHORT)} "
                              f"(e.g. 'async:k=2:partial')")
        opts[_SHORT[key]] = value if eq else True
    return kind, opts


def parse_schedule(x: Any) -> ScheduleSpec:
    """A schedule: "sync", "one_step_off", "async:k=2[:partial][:on_stale=regenerate]",
    (kind, {options}) with the session's option names, or a ScheduleOptions."""
    if isinstance(x, ScheduleSpec):
        return x
    if isinstance(x, ScheduleOptions):
        opts = x
    else:
        kind, kw = _from_string(x) if isinstance(x, str) else (x[0], dict(x[1]) if len(x) > 1 else {})
        try:
            opts = ScheduleOptions(kind=kind, **kw)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(map(str, err["loc"])) or "schedule"
            what = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            raise ConfigError(f"schedule {x!r}: {where}: {what} (kinds: {', '.join(SCHEDULES)}; async options: "
                              f"max_staleness, partial_rollout, on_stale)") from None
    return ScheduleSpec(opts)


def parse_schedules(schedule: Any) -> list[ScheduleSpec]:
    if isinstance(schedule, (str, ScheduleSpec, ScheduleOptions)) or (
            isinstance(schedule, tuple) and len(schedule) == 2 and isinstance(schedule[1], dict)):
        schedule = [schedule]
    return [parse_schedule(s) for s in schedule]


# ---- the recording -------------------------------------------------------------------------------

DEFAULT_KNOBS = {"slots_per_row": 2.0, "refresh_every": 16}  # SyntheticParams' defaults (a test checks)
SAMPLES = 16  # replays per schedule when the calls' seconds are drawn (Knobs.jitter); a few ms each


@dataclass(frozen=True)
class Knobs:
    """The streaming decoder's knobs. None: from the recording (a Session's rollout node params
    for slots_per_row and refresh_every, else DEFAULT_KNOBS; decode_s and prompt_tokens fitted)."""

    slots_per_row: float | None = None
    refresh_every: int | None = None
    between_calls: bool | None = None
    """Whether the rollout keeps decoding between two calls (the synthetic decoder is a server: True;
    the real engines decode inside a call only: False). None: True."""
    rewarm: bool | None = None
    """Whether a run of another schedule (a reopened session) pays the recording's warm-up again: the
    real engines are built again and their first updates are slow again (True: the warm-up steps
    are replayed as recorded); the synthetic DAG is warm at once (None: False: replayed at the
    costs fitted on the steps after them)."""
    stream_decode_s: float | None = None
    """Seconds per decode iteration of the streaming engine partial rollouts run on; None: decode_s,
    fitted on the sync run's static batches (`calibrate_streaming` measures it)."""
    stream_call_s: float | None = None
    """Seconds a streaming rollout call costs besides its decode iterations: admitting (prefilling)
    its prompts and resuming the sequences a weight update preempted (vLLM: about 0.13 s a call on
    the tiny model, more than its 5-10 iterations); None: 0 (`calibrate_streaming` measures it)."""
    contention: tuple[float, float] | None = None
    """(generation, training): how much slower each lane runs while the other runs too (the groups
    share the machine's cores); None: (1, 1), or what `calibrate_lanes` measured."""
    group_size: int | None = None
    """Sequences per prompt a streaming call returns whole: a real engine returns a prompt when its
    longest answer has finished, and drops the prompt whole when one of them ages out (rollout.n);
    None: 1 (the synthetic decoder returns sequences)."""
    jitter: float | None = None
    """How much a real lane call's seconds vary around the cost model (the spread of the log of
    real / modelled seconds as a standard deviation, robust to a stall: `fit_jitter` on
    calibrate_lanes' run); the replay then runs each schedule `samples` times with every call's
    seconds drawn around the model's (SimDispatch) and pools them. None: 0, one deterministic replay."""
    decode_s: float | None = None
    prompt_tokens: float | None = None

    def over(self, base: "Knobs") -> "Knobs":
        """These knobs where set, else `base`'s."""
        return Knobs(**{k: v if v is not None else getattr(base, k) for k, v in vars(self).items()})


def calibrate_lanes(s: Any, rec: "LaneRecording", updates: int = 6, skip: int = 2, streaming: bool = True
                    ) -> "LaneRecording":
    """The recording with what a short calibration on the session measures: `updates` one_step_off
    updates (the session reopened: the same batches as its sync recording) give the lanes'
    contention (`fit_contention`); with `streaming`, `updates` async k=1 updates with partial
    rollouts give the streaming engine's decode cost (`calibrate_streaming`). Each is noted in
    `rec.notes`. (Its first updates would also show the warm-up a reopened session pays, but that
    varies from one reopen to the next: replaying them made async k=4's staleness worse, TV 0.83
    against 0.33 on the synthetic DAG, so the warm-up stays Knobs.rewarm's.)"""
    s.reopen(schedule="one_step_off")
    s.run(updates, progress=False)
    busy = s.controller.schedule.stats.busy  # (start, end) per lane call, in launch order
    f = fit_contention(rec, busy, skip)
    jitter = fit_jitter(rec, busy, skip, f)
    knobs = dataclasses.replace(rec.knobs, contention=f, jitter=jitter)
    notes = [f"contention: each lane {f[0]:.3f}x slower while the other runs too; a lane call within "
             f"{jitter:.1%} (log spread) of that model (calibrate_lanes)"]
    fit = calibrate_streaming(s, updates, skip) if streaming else None
    if fit is not None:
        knobs = dataclasses.replace(knobs, stream_call_s=fit[0], stream_decode_s=fit[1])
        notes.append(f"streaming rollout: {fit[0] * 1e3:.1f} ms a call + {fit[1] * 1e3:.2f} ms an iteration "
                     f"(calibrate_streaming), against {rec.decode_s * 1e3:.2f} ms an iteration on the sync run's "
                     f"static batches")
        # a partial batch holds shorter rows than any sync batch: its training cost is fitted on such batches
        # too, not extrapolated from the sync ones (where a fixed cost per update hides: HF, tiny model,
        # 0.05 s predicted against 0.10 s real for a batch of 128 rows of about 10 tokens)
        rec = refit_training(rec, training_rows(s, skip, rec.micro_token_budget), skip)
        t = rec.train_fit
        notes.append(f"training: {t.a * 1e3:.1f} ms + {t.slope * 1e6:.2f} us a {t.feature} token"
                     + (f" + {t.per_micro * 1e3:.1f} ms a micro-batch" if t.micro_known else "")
                     + " (fitted on the recording and the partial updates of calibrate_streaming)")
    return dataclasses.replace(rec, knobs=knobs, notes=[*rec.notes, *notes])


def calibrate_micro(s: Any, rec: "LaneRecording", budget: int, updates: int = 6, skip: int = 2
                    ) -> "LaneRecording":
    """The recording with training's cost per micro-batch (`TrainFit.per_micro`), fitted on its
    steps and `updates` sync updates of the session reopened with actor.micro_token_budget=`budget`
    together (after `skip` each): a recording at one budget usually runs one micro-batch an update,
    which leaves that cost unknown. The session is reopened at the recording's budget after."""
    if rec.micro_token_budget is None:
        raise ValueError("calibrate_micro: the recording's training has no micro_token_budget (a session opened "
                         "without a run config, e.g. the synthetic DAG, trains no real engine)")
    s.reopen(schedule="sync", overrides=[f"actor.micro_token_budget={budget}"])
    try:
        s.run(updates, progress=False)
        rows = training_rows(s, skip, budget)
    finally:
        s.reopen(overrides=[f"actor.micro_token_budget={rec.micro_token_budget}"])
    rec = refit_training(rec, rows, skip)
    fit = rec.train_fit
    what = (f"{fit.per_micro * 1e3:.1f} ms a micro-batch" if fit.micro_known else
            "no cost per micro-batch that fits (the steps at both budgets ran as many micro-batches, or it came out < 0)")
    return dataclasses.replace(rec, train_fit=fit, notes=[*rec.notes, f"training: {what} (calibrate_micro: "
                                                                      f"{updates} sync updates at budget {budget})"])


def training_rows(s: Any, skip: int, budget: int | None) -> pd.DataFrame:
    """Per update of the session's current run (any schedule), after `skip`: its training lane's
    seconds ((1 - schedule/trainer_idle) x wall, as in a recording) and what it trained on
    (`train_features` of the first training stage's rows per rank, packed at `budget`)."""
    m = s.metrics
    lanes = _lanes_from_metrics(m[m["update"] >= skip])
    train_stage = next(st.id for st in s.plan.stages if st.group == s.plan.groups[-1][0])
    it = s.items()
    it = it[(it["stage"] == train_stage) & it["update"].isin(lanes.index)]
    out = pd.DataFrame({u: train_features(v, budget) for u, v in _rows_per_rank(it, "update").items()}).T.astype(float)
    out["train_s"] = lanes["train_s"].reindex(out.index)
    return out.dropna()


def _rows_per_rank(items: pd.DataFrame, by: str) -> dict[int, list[np.ndarray]]:
    """Per `by` (batch_id or update): each data-parallel rank's rows' tokens, in order."""
    return {int(k): [g2["tokens"].to_numpy(float) for _, g2 in g.groupby("dp_rank")] for k, g in items.groupby(by)}


def refit_training(rec: "LaneRecording", rows: pd.DataFrame, skip: int) -> "LaneRecording":
    """The recording with `rows` (a calibration's `training_rows`) added to what its training fit
    uses, and the fit redone over its batches after `skip` and every such row."""
    rows = rows if rec.fit_rows is None else pd.concat([rec.fit_rows, rows], ignore_index=True)
    fit = _fit_train(pd.concat([rec.batches.iloc[skip:], rows], ignore_index=True), 0)
    return dataclasses.replace(rec, fit_rows=rows, train_fit=fit)


def with_micro_budget(rec: "LaneRecording", budget: int) -> "LaneRecording":
    """The recording as if training had packed its micro-batches to `budget` tokens: each batch's
    training seconds move by what the fit says its new packing costs more or less (the batch's
    own difference from the fit is kept); partial batches are packed to `budget` too."""
    if budget == rec.micro_token_budget:
        return rec
    if rec.micro_token_budget is None:
        raise ValueError(f"micro_token_budget={budget}: the recording's training has no micro-batches (a session "
                         f"without a run config, e.g. the synthetic DAG)")
    if not rec.train_fit.micro_known:
        raise ValueError(f"micro_token_budget={budget}: the recording ran at one budget ({rec.micro_token_budget}), "
                         f"so a micro-batch's cost is unknown; calibrate_micro (advise(calibrate=n)) measures it")
    b, fit = rec.batches.copy(), rec.train_fit
    for r in b.index:
        if int(r) in rec.row_tokens:
            new = train_features(rec.row_tokens[int(r)], budget)
            b.loc[r, "train_s"] = max(0.0, float(b.at[r, "train_s"]) + fit.seconds(new) - fit.seconds(b.loc[r]))
            b.loc[r, ["padded", "n_micro"]] = [new["padded"], new["n_micro"]]
    return dataclasses.replace(rec, batches=b, micro_token_budget=budget,
                               notes=[*rec.notes, f"training at micro_token_budget={budget} (recorded at "
                                                  f"{rec.micro_token_budget}): repacked, {fit.per_micro * 1e3:.1f} ms "
                                                  f"a micro-batch"])


def _overlap(a: float, b: float, others: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for c, d in others)


def fit_contention(rec: "LaneRecording", busy: dict[str, list[tuple[float, float]]], skip: int
                   ) -> tuple[float, float]:
    """How much slower a lane ran while the other ran, from a one_step_off run of the recording's
    batches (`busy`: each lane's calls, in launch order): a lane of d seconds that overlapped the
    other for o seconds, and ran alone for s seconds in the sync recording, did s = (d - o) + o / f
    seconds of work, so d - s = o (1 - 1/f): 1 - 1/f is the median of (d - s) / o over both lanes'
    calls after `skip`, each weighted by its overlap o, one f for both. A median, not least squares:
    one call stalled by something else on the machine is not contention. (A fresh-clone CI
    predicted the synthetic DAG's one_step_off 18 % under, its trainer waiting 20 % of each update
    against 1.5 % real; f = 1.3 reproduces that on a recording of this machine, where the fit
    gives 1.02, and least squares gives f = 1.8 from one call of sixteen stalled 1 s: a test.)
    (Fitted per lane from ten updates, the generation lane's f swung from 1.0 to 1.8 between two
    vLLM runs; pooled it stays within 1.00-1.10; tried per lane again on 2026-12-07, it passed
    the real-engine benchmarks no better and failed the synthetic real-run test in a fresh-clone
    CI: 25 % under, the trainer predicted idle 28 % of its updates against 2 % real;
    benchmarks/results/schedule_replay_history.md). 1.0 where nothing overlapped or nothing
    slowed down."""
    x, d, s = _lane_calls(rec, busy, skip)
    ok = x > 0
    if not ok.any():
        return 1.0, 1.0
    # the weighted median (the lower value on a tie): 1 - 1/f, f in [1, 10]
    c = float(np.clip(np.quantile((d - s)[ok] / x[ok], 0.5, weights=x[ok], method="inverted_cdf"), 0.0, 0.9))
    return 1.0 / (1.0 - c), 1.0 / (1.0 - c)


def fit_jitter(rec: "LaneRecording", busy: dict[str, list[tuple[float, float]]], skip: int,
               contention: tuple[float, float]) -> float:
    """How far the calls of the same run vary around the contention model: the spread of
    log(real / modelled seconds) over both lanes' calls after `skip`, as a standard deviation read
    from the median absolute deviation (1.4826 MAD: a stalled call does not widen every call's
    draw, as it would the standard deviation; 0 with fewer than 3 calls)."""
    x, d, s = _lane_calls(rec, busy, skip)
    model = s + x * (1.0 - 1.0 / contention[0])
    ok = (model > 0) & (d > 0)
    if ok.sum() < 3:
        return 0.0
    r = np.log(d[ok] / model[ok])
    return float(1.4826 * np.median(np.abs(r - np.median(r))))


def _lane_calls(rec: "LaneRecording", busy: dict[str, list[tuple[float, float]]], skip: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Both lanes' calls after `skip` of a run of the recording's batches: (seconds it overlapped
    the other lane, its seconds, the sync recording's seconds of the same batch's lane)."""
    x, d, s = [], [], []
    for kind, other, col in (("generate", "train", "gen_s"), ("train", "generate", "train_s")):
        for r, (a, b) in enumerate(busy[kind]):
            if r >= skip and r in rec.batches.index:
                x.append(_overlap(a, b, busy[other]))
                d.append(b - a)
                s.append(float(rec.batches.at[r, col]))
    return np.asarray(x, float), np.asarray(d, float), np.asarray(s, float)


def calibrate_streaming(s: Any, updates: int = 6, skip: int = 2) -> tuple[float, float] | None:
    """Run `updates` async k=1 updates with partial rollouts on the session (reopened) and fit the
    streaming engine's cost: per call, rollout compute seconds = a + d * decode iterations
    (`rollout/decode_iterations`; least squares over the calls after `skip`; (a, d)). None: the
    rollout does not count its iterations (the synthetic decoder's cost is its own knob: a session
    without a run config, e.g. the synthetic DAG, spends no updates on finding that out)."""
    if not _runs_real_engines(s):
        return None
    s.reopen(schedule="async", max_staleness=1, partial_rollout=True)
    m = s.run(updates, progress=False)
    if "rollout/decode_iterations" not in m:
        return None
    m = m[m["update"] >= skip]
    rollout = next(st.id for st in s.plan.stages if st.type == "generate")
    sp = s.spans
    sec = sp[(sp["stage"] == rollout) & (sp["phase"] == "compute")].groupby(["batch_id", "worker"])["seconds"].sum() \
        .groupby("batch_id").max().reindex(m["update"]).to_numpy(float)
    iters = m["rollout/decode_iterations"].to_numpy(float) / max(1, s.plan.stage(rollout).dp)  # per rank: counts add up
    ok = np.isfinite(sec) & np.isfinite(iters) & (iters > 0)
    sec, iters = sec[ok], iters[ok]
    if not len(sec):
        return None
    if len(sec) >= 3 and np.ptp(iters) > 0:
        d, a = np.polyfit(iters, sec, 1)
        if d > 0 and a >= 0:
            return float(a), float(d)
    return 0.0, float(sec.sum() / iters.sum())


@dataclass
class LaneRecording:
    """A sync run's lanes per batch, and what partial rollouts need."""

    batches: pd.DataFrame  # index batch r: gen_s, train_s, gap_s, wall_s, tokens, rows, padded, n_micro, rollout_s
    lengths: dict[int, list[np.ndarray]]  # batch -> per rollout rank: response lengths (decode iterations)
    train_fit: "TrainFit"
    decode_s: float  # one decode iteration
    prompt_tokens: float  # per sequence
    knobs: Knobs
    weight_sync: dict[str, float]  # median seconds per update: pull (rollout group), publish (training group)
    colocated: bool = False
    notes: list[str] = field(default_factory=list)
    row_tokens: dict[int, list[np.ndarray]] = field(default_factory=dict)  # batch -> per training rank: its rows' tokens
    micro_token_budget: int | None = None  # the training engine's (actor.micro_token_budget); None: one micro-batch
    fit_rows: pd.DataFrame | None = None  # calibration updates the training fit also uses: train_s and features


def _lanes_from_metrics(m: pd.DataFrame) -> pd.DataFrame:
    wall = m["wall_s"].astype(float)
    gen = (1 - m["schedule/rollout_idle"].astype(float)).clip(0, 1) * wall
    train = (1 - m["schedule/trainer_idle"].astype(float)).clip(0, 1) * wall
    return pd.DataFrame({"gen_s": gen.values, "train_s": train.values, "wall_s": wall.values},
                        index=m["update"].astype(int).values)


def _stage_seconds(spans: pd.DataFrame, stages: list[str]) -> pd.Series:
    """Per batch: the sum over `stages` of the slowest worker's spans of that stage (nested ones out)."""
    s = spans[spans["stage"].isin(stages) & (spans["worker"] != DRIVER) & ~spans["phase"].isin(NESTED_PHASES)]
    return s.groupby(["batch_id", "stage", "worker"])["seconds"].sum().groupby(["batch_id", "stage"]).max().groupby(
        "batch_id").sum()


def _counted_prompts(items: pd.DataFrame, metrics: pd.DataFrame | None, rollout: str) -> pd.Series | None:
    """Per batch: the tokens of a rollout item the engine did not decode (its prompt; a multi-turn
    row's tool replies too), counted: the mean item tokens less the batch's logged
    `response_length/mean`. None where the run logs no response lengths (the synthetic DAG).
    (Fitting it from the clock instead, as the intercept below, is noise: a per-call cost drove
    it to 0 instead of ~4 tokens on the real engines, and every replayed sequence decoded 4
    iterations too long, enough to move partial rollouts' staleness by TV 0.17.)"""
    if metrics is None or "response_length/mean" not in metrics:
        return None
    it = items[items["stage"] == rollout]
    mean_tokens = it.groupby("update")["tokens"].mean()
    response = metrics.set_index(metrics["update"].astype(int))["response_length/mean"].astype(float)
    p = (mean_tokens - response.reindex(mean_tokens.index)).dropna()
    by_batch = it.drop_duplicates("batch_id").set_index("batch_id")["update"]
    p = by_batch.map(p).dropna()
    return p.clip(lower=0) if len(p) else None


def _fit_decode(items: pd.DataFrame, spans: pd.DataFrame, rollout: str, skip: int,
                prompt: float | None = None) -> tuple[float, float]:
    """(d, p): rollout seconds = d * (longest item tokens - p) per (step, dp rank), least squares;
    the static batch waits for its longest response. `prompt`: p counted (`_counted_prompts`);
    then d is the slope alone, and p the intercept only where nothing counted it."""
    it = items[(items["stage"] == rollout) & (items["batch_id"] >= skip)]
    longest = it.groupby(["batch_id", "worker"])["tokens"].max()
    sp = spans[(spans["stage"] == rollout) & (spans["phase"] == "compute") & (spans["batch_id"] >= skip)]
    sec = sp.groupby(["batch_id", "worker"])["seconds"].sum()
    both = pd.concat({"x": longest, "y": sec}, axis=1).dropna()
    floor = float(it["tokens"].min()) - 1 if len(it) else 0.0  # every response has a token
    if len(both) >= 3 and np.ptp(both["x"]) > 0:
        d, icpt = np.polyfit(both["x"].to_numpy(float), both["y"].to_numpy(float), 1)
        if d > 0:
            return float(d), float(prompt if prompt is not None else np.clip(-icpt / d, 0, floor))
    if not len(both):
        raise ValueError(f"the recording has no compute spans of the rollout stage {rollout!r} with items")
    p = prompt if prompt is not None else 0.0
    return float((both["y"] / (both["x"] - p).clip(lower=1)).median()), float(p)


TRAIN_FEATURES = ("padded", "tokens")  # what training seconds may grow with, the first preferred on a tie


@dataclass(frozen=True)
class TrainFit:
    """train_s = a + slope * x + per_micro * micro-batches, x the padded tokens (each micro-batch
    padded to its longest row: a batch pays for its long tail, as the real engines' training
    does) or the tokens trained (as the synthetic DAG's simulated training does). `per_micro`
    is known (`micro_known`) only where the fitted steps ran different numbers of micro-batches
    (a recording at one micro_token_budget usually runs one per update: `calibrate_micro`)."""

    a: float
    slope: float
    feature: str
    per_micro: float = 0.0
    micro_known: bool = False

    def seconds(self, features: dict) -> float:
        return self.a + self.slope * features[self.feature] + self.per_micro * features["n_micro"]

    def scaled(self, t: float) -> "TrainFit":
        return dataclasses.replace(self, a=self.a * t, slope=self.slope * t, per_micro=self.per_micro * t)


def train_features(row_tokens: list[np.ndarray], budget: int | None) -> dict:
    """What training computes on, per training rank's rows (tokens each, in order) packed as
    its engine packs them (models/fsdp.pack_rows; budget None: one micro-batch a rank): tokens,
    rows, padded tokens (each micro-batch's rows x its longest) and micro-batches, summed."""
    from distflow_lab.models.fsdp import pack_rows

    out = {"tokens": 0.0, "rows": 0, "padded": 0.0, "n_micro": 0}
    for rows in row_tokens:
        rows = np.asarray(rows, float)
        plan = pack_rows(rows.tolist(), budget) if budget else [list(range(len(rows)))]
        for ix in filter(None, plan):
            out["padded"] += len(ix) * float(rows[ix].max())
        out["tokens"] += float(rows.sum())
        out["rows"] += len(rows)
        out["n_micro"] += sum(1 for ix in plan if ix)
    return out


def _fit_train(b: pd.DataFrame, skip: int) -> TrainFit:
    """TrainFit (least squares over the steps after `skip`) on the feature that fits better;
    with a per-micro-batch term where the steps' micro-batch counts differ (every term >= 0)."""
    y = b["train_s"].to_numpy(float)[skip:]
    n = b["n_micro"].to_numpy(float)[skip:] if "n_micro" in b else np.zeros(len(y))
    fits = []
    for feature in TRAIN_FEATURES:
        x = b[feature].to_numpy(float)[skip:]
        if len(y) >= 3 and np.ptp(n) > 0:
            coef = _nonneg_lstsq(np.column_stack([np.ones_like(x), x, n]), y)
            fit = TrainFit(float(coef[0]), float(coef[1]), feature, float(coef[2]), True)
        else:
            fit = TrainFit(*_line(x, y), feature)
        pred = np.array([fit.seconds({feature: xi, "n_micro": ni}) for xi, ni in zip(x, n)])
        fits.append((float(((pred - y) ** 2).sum()) if len(y) else 0.0, fit))
    return min(fits, key=lambda f: f[0])[1]


def _nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin |a c - y| over c >= 0, for a few columns: the best least-squares fit on every subset
    of them (the others 0) whose coefficients all come out >= 0."""
    best, best_r = np.zeros(a.shape[1]), float((y ** 2).sum())
    for mask in range(1, 2 ** a.shape[1]):
        cols = [j for j in range(a.shape[1]) if mask >> j & 1]
        c = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        r = float(((a[:, cols] @ c - y) ** 2).sum())
        if (c >= 0).all() and r < best_r - 1e-15:
            best, best_r = np.zeros(a.shape[1]), r
            best[cols] = c
    return best


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) >= 0 of y against x: least squares, else through the origin, else the mean."""
    if len(x) >= 2 and np.ptp(x) > 0:
        slope, a = np.polyfit(x, y, 1)
        if slope >= 0 and a >= 0:
            return float(a), float(slope)
        return 0.0, float((x * y).sum() / (x * x).sum())
    return float(y.mean() if len(y) else 0.0), 0.0


@dataclass
class _Source:
    """What a Session or a run dir holds, in one shape."""

    spans: pd.DataFrame
    metrics: pd.DataFrame
    items: pd.DataFrame
    gen_stages: list[str]
    train_stages: list[str]
    rollout: str
    knobs: Knobs
    colocated: bool
    micro_token_budget: int | None = None


def _knobs_from_params(params: dict) -> Knobs:
    return Knobs(**{k: type(v)(params.get(k, v)) for k, v in DEFAULT_KNOBS.items()})


def _runs_real_engines(s: Any) -> bool:
    """A session opened from a run config: its rollout is a real engine (hf, vllm), not the synthetic DAG's decoder."""
    return getattr(s.config, "algo", None) is not None


def _session_knobs(s: Any, rollout: Any) -> Knobs:
    """The synthetic rollout's node params; on a real engine (hf, vllm) algos/streaming.py's constants."""
    if _runs_real_engines(s) and not set(DEFAULT_KNOBS) & set(rollout.params):
        from distflow_lab.algos.streaming import REFRESH_EVERY, SLOTS_PER_ROW

        return Knobs(slots_per_row=float(SLOTS_PER_ROW), refresh_every=REFRESH_EVERY, between_calls=False,
                     rewarm=True, group_size=s.config.algo.rollout.n)
    return _knobs_from_params(rollout.params)


def _from_session(s: Any) -> _Source:
    plan = s.plan
    if s.config.schedule.kind != "sync":
        raise ValueError(f"a schedule replay starts from a sync run; this session runs {s.config.schedule.kind!r} "
                         f"(reopen(schedule='sync') and run it first)")
    rollout = next((st for st in plan.stages if st.type == "generate"), None)
    if rollout is None:
        raise ValueError(f"the plan has no generate stage (a rollout) to replay: stages "
                         f"{[st.id for st in plan.stages]}")
    if plan.groups:
        gen_group = plan.groups[0][0]
        gen = [st.id for st in plan.stages if st.group == gen_group]
    else:
        first = next((st.index for st in plan.stages if st.role in TRAIN_ROLES), len(plan.stages))
        gen = [st.id for st in plan.stages[:first]]
    train = [st.id for st in plan.stages if st.id not in gen]
    algo = getattr(s.config, "algo", None)
    return _Source(s.spans, s.metrics, s.items(), gen, train, rollout.id, _session_knobs(s, rollout),
                   not plan.groups, algo.actor.micro_token_budget if algo is not None else None)


def _from_dir(d: Path, rollout: str, train_from: str | None) -> _Source:
    need = [d / f for f in ("spans.parquet", "metrics.parquet", "items.parquet")]
    missing = [p.name for p in need if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{d} lacks {missing}: a schedule replay needs spans, metrics and items")
    spans, metrics, items = (read_saved(p, t) for p, t in zip(need, ("spans", "metrics", "items")))
    order = items.drop_duplicates("stage").sort_values("stage_index")["stage"].tolist()
    workers = spans[spans["worker"] != DRIVER].groupby("stage")["worker"].agg(frozenset)
    split = train_from or next((st for st in order if workers.get(st) != workers.get(order[0])), None)
    if split is None:
        raise ValueError(f"{d}: every stage ran on the same workers (colocated): name the first training stage, "
                         f"train_from=..., stages {order}")
    gen = order[:order.index(split)]
    return _Source(spans, metrics, items, gen, order[len(gen):], rollout, Knobs(**DEFAULT_KNOBS),
                   train_from is not None)


def _batches(src: _Source) -> tuple[pd.DataFrame, dict[int, list[np.ndarray]]]:
    m = src.metrics
    if m is None or not len(m):
        raise ValueError("the recording has no steps: run the sync schedule first")
    lanes_known = {"schedule/rollout_idle", "schedule/trainer_idle"} <= set(m.columns) and not src.colocated
    if lanes_known:
        if "schedule/staleness" in m and (m["schedule/staleness"].fillna(0) != 0).any():
            raise ValueError("a schedule replay starts from a sync run; this recording has stale batches "
                             "(schedule/staleness > 0): it ran another schedule")
        b = _lanes_from_metrics(m)
    else:  # colocated: the stages' critical paths
        b = pd.DataFrame({"gen_s": _stage_seconds(src.spans, src.gen_stages),
                          "train_s": _stage_seconds(src.spans, src.train_stages)})
        b["wall_s"] = m.set_index(m["update"].astype(int))["wall_s"].reindex(b.index).astype(float)
    first_train = src.items[src.items["stage"] == src.train_stages[0]]
    if not len(first_train):
        raise ValueError(f"the recording has no items of the first training stage {src.train_stages[0]!r} "
                         f"(items() is empty: was the run recorded with an older version?)")
    row_tokens = _rows_per_rank(first_train, "batch_id")
    feats = pd.DataFrame({r: train_features(v, src.micro_token_budget) for r, v in row_tokens.items()}).T
    b[["tokens", "rows", "padded", "n_micro"]] = feats[["tokens", "rows", "padded", "n_micro"]].astype(float)
    b["rollout_s"] = _stage_seconds(src.spans, [src.rollout])
    b = b.dropna(subset=["gen_s", "train_s", "wall_s", "tokens"])
    b["gap_s"] = (b["wall_s"] - b["gen_s"] - b["train_s"]).clip(lower=0)
    b["rollout_s"] = b["rollout_s"].fillna(0).clip(upper=b["gen_s"])
    return b.rename_axis("batch"), row_tokens


def load_lanes(source: Any, *, skip: int = 1, knobs: Knobs | None = None, rollout: str = "rollout",
               train_from: str | None = None) -> LaneRecording:
    """A LaneRecording from a Session (its sync run so far) or a run directory (spans,
    metrics, items parquet; `rollout`: the rollout stage; `train_from`: the first training
    stage, needed for a colocated run dir). `skip`: warm-up steps the fits leave out."""
    if isinstance(source, LaneRecording):
        return source
    src = _from_dir(Path(source), rollout, train_from) if isinstance(source, (str, Path)) else _from_session(source)
    b, row_tokens = _batches(src)
    if not len(b):
        raise ValueError("the recording has no step with lanes and items to replay")
    skip = min(skip, len(b) - 1)
    counted = _counted_prompts(src.items, src.metrics, src.rollout)
    warm = None if counted is None else counted[counted.index >= skip]
    d, p = _fit_decode(src.items, src.spans, src.rollout, skip,
                       None if counted is None else float((warm if len(warm) else counted).median()))
    given = (knobs or Knobs()).over(src.knobs)
    knobs = given.over(Knobs(decode_s=d, prompt_tokens=p))
    d, p = knobs.decode_s, knobs.prompt_tokens
    # each batch's own counted prompt unless a knob sets one for all
    prompts = counted.to_dict() if counted is not None and given.prompt_tokens is None else {}
    it = src.items[src.items["stage"] == src.rollout]
    lengths = {int(r): [np.maximum(1, np.round(g2["tokens"].to_numpy(float) - prompts.get(r, p))).astype(np.int64)
                        for _, g2 in g.groupby("dp_rank")] for r, g in it.groupby("batch_id")}
    if not knobs.rewarm:
        b = _dewarm(b, skip, lengths, d, _fit_train(b, skip))
    ws = src.spans[src.spans["phase"] == "weight_sync"]
    sync = {"pull_s": float(ws[ws["stage"].isin(src.gen_stages)].groupby(["batch_id", "worker"])["seconds"].sum()
                            .groupby("batch_id").max().median()) if len(ws) else 0.0,
            "publish_s": float(ws[ws["stage"].isin(src.train_stages)].groupby(["batch_id", "worker"])["seconds"].sum()
                               .groupby("batch_id").max().median()) if len(ws) else 0.0}
    notes = []
    if src.colocated:
        notes.append(f"colocated recording: generation = {src.gen_stages}, training = {src.train_stages}, each "
                     f"assumed to keep its recorded per-stage times on a group of its own")
    if skip and not knobs.rewarm:
        notes.append(f"the first {skip} recorded step(s) (warm-up: engines, caches) are replayed at the fitted costs "
                     f"(training a + b * padded or trained tokens, rollout d * longest response), not their recorded seconds")
    elif skip:
        notes.append(f"the first {skip} recorded step(s) (warm-up) are replayed as recorded: a reopened session's "
                     f"real engines pay their warm-up again (Knobs.rewarm)")
    return LaneRecording(b, lengths, _fit_train(b, skip), d, p, knobs, {k: (0.0 if math.isnan(v) else v)
                                                                        for k, v in sync.items()},
                         src.colocated, notes, row_tokens, src.micro_token_budget)


def _dewarm(b: pd.DataFrame, skip: int, lengths: dict[int, list[np.ndarray]], d: float,
            fit: TrainFit) -> pd.DataFrame:
    """The warm-up steps' lanes at the costs fitted on the steps after them: a schedule run on
    warm workers (a reopened session) does not pay a fresh session's first-step costs again."""
    if not skip:
        return b
    b = b.copy()
    rest = b.iloc[skip:]
    other = float((rest["gen_s"] - rest["rollout_s"]).median())
    for r in b.index[:skip]:
        longest = max((int(x.max()) for x in lengths.get(int(r), []) if len(x)), default=0)
        rollout = d * longest if longest else float(rest["rollout_s"].median())
        b.loc[r, ["rollout_s", "gen_s", "train_s", "gap_s"]] = [rollout, rollout + other,
                                                               fit.seconds(b.loc[r]),
                                                               float(rest["gap_s"].median())]
    return b


# ---- the pipeline --------------------------------------------------------------------------------

@dataclass
class _Seq:
    length: int
    prompt: float
    versions: list[tuple[int, int]] = field(default_factory=list)  # (version, tokens), in decode order
    done: int = 0
    group: int = 0  # the prompt it answers (Knobs.group_size answers a prompt)

    @property
    def left(self) -> int:
        return self.length - self.done

    def decode(self, n: int, version: int) -> None:
        n = min(n, self.left)
        if n > 0:
            self.versions.append((version, n))
            self.done += n


@dataclass
class _Gen:
    """A generated batch: its rows' oldest versions, tokens per version, tokens trained."""

    batch: int
    ix: int  # the recorded batch (row of LaneRecording.batches) it stands for
    version: int
    row_versions: np.ndarray
    token_versions: Counter
    tokens: float
    end: float
    start: float
    stale: int = 0  # sequences aged out (dropped or restarted) in this generation
    row_tokens: np.ndarray | None = None  # a partial batch's rows' tokens (prompt + response), for its training cost

    @property
    def version_min(self) -> int:
        return int(self.row_versions.min()) if len(self.row_versions) else self.version


class _Decoder:
    """`synthetic.StreamingDecoder` in simulated time (one per rollout rank)."""

    def __init__(self, stream: Iterator[np.ndarray], prompt: float, group_size: int = 1) -> None:
        self.stream, self.prompt, self.group_size = stream, prompt, max(1, group_size)
        self.waiting: deque[_Seq] = deque()
        self.active: list[_Seq] = []
        self.finished: list[_Seq] = []
        self.paused: tuple[float, int] | None = None
        self.sizes: dict[int, int] = {}  # prompt -> its answers
        self.next_group = 0

    def admit(self) -> int:
        lengths = next(self.stream, None)  # a rank's recorded rows: a prompt's answers are consecutive
        if lengths is None:  # a finite stream (a test's) ran out: nothing more to admit
            return 0
        new = [_Seq(int(n), self.prompt, group=self.next_group + j // self.group_size) for j, n in enumerate(lengths)]
        for q in new:
            self.sizes[q.group] = self.sizes.get(q.group, 0) + 1
        self.next_group += -(-len(new) // self.group_size)
        self.waiting.extend(new)
        return len(new)

    def _between_calls(self, now: float, d: float) -> None:
        if self.paused is None or not self.active:
            return
        since, version = self.paused
        iters = int((now - since) / d)
        for s in sorted(self.active, key=lambda s: s.left):
            s.decode(iters, version)
        self.finished += [s for s in sorted(self.active, key=lambda s: s.left) if s.left <= 0]
        self.active = [s for s in self.active if s.left > 0]

    def _age_out(self, done: list[_Seq], version: int, spec: ScheduleSpec, trains_by: int, check_done: bool
                 ) -> tuple[list[_Seq], int]:
        """Sequences too old to train at the update they would train at (of `done`, when `check_done`,
        and the active ones): restarted (on_stale regenerate), or dropped with every started or
        finished answer of their prompt; (what is left of `done`, how many aged out)."""
        trains_at = max(version, trains_by)
        old = [s for s in (done if check_done else []) + self.active
               if s.versions and trains_at - s.versions[0][0] > spec.k]
        if not old:
            return done, 0
        if spec.on_stale == "regenerate":  # the prompt waits for its restarted answers
            gone = {id(s) for s in old}
            for s in old:
                self.waiting.appendleft(_Seq(s.length, s.prompt, group=s.group))
        else:
            groups = {s.group for s in old}
            gone = {id(s) for s in done + self.active if s.group in groups}
            self.waiting = deque(s for s in self.waiting if s.group not in groups)  # not started: not counted
            for g in groups:
                self.sizes[g] = 0  # nothing of it is waited for any more
        self.active = [s for s in self.active if id(s) not in gone]
        return [s for s in done if id(s) not in gone], len(gone)

    def run(self, now: float, rows: int, slots: int, knobs: Knobs, d: float, version: int, published,
            spec: ScheduleSpec, trains_by: int) -> tuple[list[_Seq], float, int]:
        """Decode until `rows` answers of whole prompts finished; (them, in the order their prompts
        completed, the time it returns, sequences aged out)."""
        if knobs.between_calls is not False:
            self._between_calls(now, d)
        done, self.finished = self.finished, []
        done, stale = self._age_out(done, version, spec, trains_by, True)
        top_up(lambda: len(self.waiting) + len(self.active), slots, self.admit)  # the engines' rule: later prompts
        t, until = now, knobs.refresh_every
        while self._whole(done) < rows:
            while len(self.active) < slots and self.waiting:
                self.active.append(self.waiting.popleft())
            if not self.active:
                break
            step = max(1, min(min(s.left for s in self.active), until))
            t += step * d
            for s in self.active:
                s.decode(step, version)
            done += [s for s in self.active if s.left <= 0]
            self.active = [s for s in self.active if s.left > 0]
            until -= step
            if until <= 0:
                version = published(t)
                done, n = self._age_out(done, version, spec, trains_by, False)
                stale, until = stale + n, knobs.refresh_every
        out, self.finished = self._take(done, rows)
        self.paused = (t, version)
        return out, t, stale

    def _complete(self, done: list[_Seq]) -> list[int]:
        """The prompts all of whose answers are in `done` (finish order), in the order they completed."""
        count, last = Counter(s.group for s in done), {s.group: i for i, s in enumerate(done)}
        return sorted((g for g, c in count.items() if c >= self.sizes[g]), key=last.__getitem__)

    def _whole(self, done: list[_Seq]) -> int:
        return sum(self.sizes[g] for g in self._complete(done))

    def _take(self, done: list[_Seq], rows: int) -> tuple[list[_Seq], list[_Seq]]:
        """(the first completed prompts' answers, up to `rows`; the rest of `done`)."""
        take, n = set(), 0
        for g in self._complete(done):
            if n + self.sizes[g] > rows:
                break
            take.add(g)
            n += self.sizes[g]
        return [s for s in done if s.group in take], [s for s in done if s.group not in take]


def _cycle(n: int, skip: int) -> Iterator[int]:
    """0, 1, ..., n - 1, then the steps after the warm-up again and again."""
    yield from range(n)
    while True:
        yield from range(min(skip, n - 1), n)


class SegmentCosts:
    """The cost model of one schedule's replay: what a generation segment and a training segment
    take, in simulated time, from the recording (the fits above) and the streaming decoder's rules.
    `runtime/schedule_lanes.Lanes` decides when each runs (experiments/sim_dispatch.py calls these)."""

    def __init__(self, rec: LaneRecording, spec: ScheduleSpec, skip: int = 1) -> None:
        self.rec, self.spec = rec, spec
        b = rec.batches
        n, self.skip = len(b), min(skip, len(b) - 1)
        self.order = list(b.index)
        self.cols = {c: b[c].to_numpy(float) for c in b.columns}
        self.decoders: list[_Decoder] | None = None
        if spec.partial:
            ranks = max(len(v) for v in rec.lengths.values()) if rec.lengths else 0
            if not ranks:
                raise ValueError("partial rollouts need the rollout's per-sequence lengths (its items); "
                                 "the recording has none")
            self.decoders = [_Decoder(self._lengths(i, n), rec.prompt_tokens, rec.knobs.group_size or 1)
                             for i in range(ranks)]
        self.batch_ix = _cycle(n, self.skip)
        self.ranks = max((len(v) for v in rec.row_tokens.values()), default=1)  # training ranks
        self.generated: dict[int, _Gen] = {}  # batch -> what its generation made
        self.trained: dict[int, float] = {}  # batch -> its training lane's seconds (to the publish)
        self.stale = 0  # sequences aged out (dropped or restarted) by the rollouts
        self.held = 0  # the newest version the rollout group pulled

    def _lengths(self, rank: int, n: int) -> Iterator[np.ndarray]:
        for i in _cycle(n, self.skip):
            per = self.rec.lengths.get(int(self.order[i]), [])
            if rank < len(per):
                yield per[rank]

    def _value(self, col: str, i: int) -> float:
        return float(self.cols[col][i])

    def generate(self, r: int, now: float, version: int, trains_by: int, published: Callable[[float], int]
                 ) -> tuple[float, int]:
        """Generation of batch r from `now` at `version`: (its end, its oldest token's version)."""
        i = next(self.batch_ix)
        # every recorded sync generation after the first pulled a new policy; one that runs ahead at the version
        # it holds pulls nothing (pull_weights loads only a newer version)
        saved = self.rec.weight_sync["pull_s"] if version <= self.held and self.order[i] > 0 else 0.0
        self.held = max(self.held, version)
        if self.decoders is None:
            rows = int(self._value("rows", i))
            g = _Gen(r, i, version, np.full(rows, version), Counter({version: self._value("tokens", i)}),
                     self._value("tokens", i), now + self._value("gen_s", i) - saved, now)
        else:
            g = self._generate_partial(r, i, now, version, trains_by, published, saved)
        self.generated[r], self.stale = g, self.stale + g.stale
        return g.end, g.version_min

    def _generate_partial(self, r: int, i: int, now: float, version: int, trains_by: int,
                          published: Callable[[float], int], saved: float) -> _Gen:
        other = self._value("gen_s", i) - self._value("rollout_s", i) - saved  # the lane's stages but the rollout
        rows_v, tv, tokens, end, stale, every = [], Counter(), 0.0, now, 0, []
        for dec in self.decoders:
            rows = dec.admit()
            slots = int(self.rec.knobs.slots_per_row * rows)
            k = self.rec.knobs  # a call first admits its prompts and resumes what an update preempted
            done, t, n = dec.run(now + (k.stream_call_s or 0.0), rows, slots, k, k.stream_decode_s or self.rec.decode_s,
                                 version, published, self.spec, trains_by)
            stale, end = stale + n, max(end, t)
            every += done
            for s in done:
                rows_v.append(s.versions[0][0])
                for v, c in s.versions:
                    tv[v] += c
                tokens += s.prompt + s.length
        return _Gen(r, i, version, np.asarray(rows_v, np.int64), tv, tokens, end + other, now, stale,
                    np.array([s.prompt + s.length for s in every], float))

    def train(self, r: int, now: float) -> tuple[float, float]:
        """Training on batch r from `now`: (when it publishes the policy, when its lane ends). Its
        seconds as recorded for the same batch, or from the fit for a partial batch (other
        sequences); then the driver's gap, paid on the trainer's path."""
        g = self.generated[r]
        if self.decoders is None:
            t_s, gap = self._value("train_s", g.ix), self._value("gap_s", g.ix)
        else:  # the training ranks take contiguous shards, as the data plane splits a batch
            shards = np.array_split(g.row_tokens, max(1, self.ranks))
            t_s = self.rec.train_fit.seconds(train_features(shards, self.rec.micro_token_budget))
            gap = float(np.median(self.cols["gap_s"][self.skip:]))
        self.trained[r] = t_s
        return now + t_s, now + t_s + gap


def run_schedule(rec: LaneRecording, spec: ScheduleSpec, updates: int, skip: int = 1, seed: int = 0
                 ) -> tuple[pd.DataFrame, dict]:
    """`updates` training updates of `spec` from a cold start: the scheduler's own `Lanes` in
    simulated time over this recording's costs (each call's seconds drawn from `seed` around
    them when the knobs have a jitter). One row per update, and totals."""
    from distflow_lab.experiments.sim_dispatch import SimDispatch
    from distflow_lab.runtime.schedule import ScheduleSetup
    from distflow_lab.runtime.schedule_lanes import Lanes

    costs = SegmentCosts(rec, spec, skip)
    sim = SimDispatch(costs, *(rec.knobs.contention or (1.0, 1.0)), jitter=rec.knobs.jitter or 0.0, seed=seed)
    lanes = Lanes(ScheduleSetup(_two_groups(), "replay", spec.schedule, sim.dispatch(), None, 0))
    rows, busy = [], []
    for _ in range(updates):
        report = lanes.step()
        m = report.metrics
        g = costs.generated[int(m["schedule/batch"])]
        rows.append(_update_row(g, report.update, report.wall_seconds, costs.trained[g.batch], sim.now))
        busy.append((1 - m["schedule/rollout_idle"]) * report.wall_seconds)
    table = pd.DataFrame(rows)
    table["rollout_busy_s"] = busy
    return table, {"dropped_batches": lanes.stats.dropped, "stale_sequences": costs.stale}


@functools.lru_cache(maxsize=1)
def _two_groups():
    """A plan on two groups of one worker (generation, training): what Lanes runs in a replay."""
    from distflow_lab.experiments.synthetic import synthetic_grpo

    return synthetic_grpo(batch_size=2, n=1, groups={"rollout": 1, "train": 1}).plan(2)


def _update_row(g: _Gen, update: int, wall: float, train_s: float, end: float) -> dict:
    return {"update": update, "batch": g.batch, "wall_s": wall, "train_s": train_s, "end_s": end,
            "gen_start_s": g.start, "gen_end_s": g.end,
            "tokens": g.tokens, "rows": len(g.row_versions), "version_min": g.version_min,
            "staleness": update - g.version_min,
            "row_staleness": Counter((update - g.row_versions).tolist()),
            "token_staleness": Counter({update - v: c for v, c in g.token_versions.items()})}


def distribution(counts: Iterable[Counter]) -> pd.Series:
    """Shares by staleness from per-update Counters."""
    total = Counter()
    for c in counts:
        total.update(c)
    s = pd.Series(total, dtype=float).sort_index()
    return s / s.sum() if s.sum() > 0 else s


def tv_distance(p: pd.Series, q: pd.Series) -> float:
    """Total-variation distance of two distributions over staleness (indices unioned)."""
    idx = p.index.union(q.index)
    return 0.5 * float((p.reindex(idx, fill_value=0) - q.reindex(idx, fill_value=0)).abs().sum())


# ---- the result ------------------------------------------------------------------------------------

@dataclass
class ScheduleReplay:
    """Predictions per schedule: `summary` (one row each), `table` (per update), `staleness`
    (shares of trained samples, and of tokens, by staleness)."""

    table: pd.DataFrame
    summary: pd.DataFrame
    staleness: pd.DataFrame
    recording: LaneRecording
    skip: int

    def staleness_of(self, name: str, by: str = "sample") -> pd.Series:
        s = self.staleness[(self.staleness["schedule"] == name) & (self.staleness["by"] == by)]
        return s.set_index("staleness")["share"]

    def _header(self) -> str:
        rec = self.recording
        med = rec.batches.iloc[min(self.skip, len(rec.batches) - 1):].median()
        return (f"Schedule replay of a sync run ({len(rec.batches)} steps; medians: generation {med['gen_s']:.3f} s, "
                f"training {med['train_s']:.3f} s, driver {med['gap_s']:.3f} s; weight sync: pull "
                f"{rec.weight_sync['pull_s'] * 1e3:.1f} ms, publish {rec.weight_sync['publish_s'] * 1e3:.1f} ms; "
                f"decode {rec.decode_s * 1e3:.2f} ms/iteration"
                + (f"; {self.table['sample'].nunique()} replays a schedule, each call's seconds drawn "
                   f"{rec.knobs.jitter:.1%} around the model" if rec.knobs.jitter else "") + ")")

    _COLS = ["schedule", "step_s", "tokens_per_s", "samples_per_s", "speedup_vs_sync", "trainer_idle",
             "rollout_idle", "staleness_mean", "staleness_dist", "dropped_batches"]

    def __repr__(self) -> str:
        cols = [c for c in self._COLS if c in self.summary]
        notes = "".join(f"\nnote: {n}" for n in self.recording.notes)
        return f"{self._header()}\n{self.summary[cols].round(4).to_string(index=False)}{notes}"

    def _repr_html_(self) -> str:
        cols = [c for c in self._COLS if c in self.summary]
        notes = "".join(f"<p><i>note: {n}</i></p>" for n in self.recording.notes)
        return f"<p><b>{self._header()}</b></p>{self.summary[cols].round(4).to_html(index=False)}{notes}"


def _dist_text(s: pd.Series) -> str:
    return " ".join(f"{int(k)}:{v:.2f}" for k, v in s.items())


def _summarize(spec: ScheduleSpec, t: pd.DataFrame, totals: dict, skip: int) -> dict:
    m = t[t["update"] >= skip]
    wall = float(m["wall_s"].sum())
    rows = distribution(m["row_staleness"])
    return {"schedule": spec.name, "kind": spec.kind, "k": spec.k, "partial_rollout": spec.partial,
            "step_s": float(m["wall_s"].median()), "tokens_per_s": float(m["tokens"].sum() / wall),
            "samples_per_s": float(m["rows"].sum() / wall),
            # as the schedule/*_idle metrics: per update, the share of its wall a lane was not busy; their mean
            "trainer_idle": float((1 - m["train_s"] / m["wall_s"]).clip(lower=0).mean()),
            "rollout_idle": float((1 - m["rollout_busy_s"] / m["wall_s"]).clip(lower=0).mean()),
            "staleness_mean": float((rows.index.to_numpy(float) * rows.to_numpy()).sum()),
            "staleness_dist": _dist_text(rows), "updates": m["update"].nunique(), "options": spec.options, **totals}


def replay_schedules(source: Any, schedule: Any = ("sync", "one_step_off", "async:k=2", "async:k=2:partial"), *,
                     updates: int | None = None, skip: int = 1, knobs: Knobs | None = None,
                     rollout: str = "rollout", train_from: str | None = None, samples: int | None = None
                     ) -> ScheduleReplay:
    """Predict each schedule from a recorded sync run (a Session, a run dir, or a LaneRecording).
    `updates`: training updates to simulate from a cold start (default: as many as recorded);
    the first `skip` are warm-up, left out of the summary; `knobs`: the streaming decoder's
    (default: the rollout node's params, or SyntheticParams' defaults). `samples`: replays per
    schedule, pooled (the table has a `sample` column); they differ only where the knobs have a
    jitter (calibrate_lanes measures it). None: SAMPLES with a jitter, else 1."""
    specs = parse_schedules(schedule)
    rec = load_lanes(source, skip=skip, knobs=knobs, rollout=rollout, train_from=train_from)
    updates = updates or len(rec.batches)
    if updates <= skip:
        raise ValueError(f"updates={updates} leaves nothing after the {skip} warm-up updates (skip)")
    samples = (SAMPLES if rec.knobs.jitter else 1) if samples is None else samples
    if samples < 1:
        raise ValueError(f"samples={samples}: a replay needs at least one sample")
    tables, rows, dists = [], [], []
    for spec in specs:
        runs = [run_schedule(rec, spec, updates, skip, seed) for seed in range(samples)]
        t = pd.concat([t.assign(sample=i) for i, (t, _) in enumerate(runs)], ignore_index=True)
        totals = {k: float(np.mean([tot[k] for _, tot in runs])) for k in runs[0][1]}
        tables.append(t.assign(schedule=spec.name))
        rows.append(_summarize(spec, t, totals, skip))
        m = t[t["update"] >= skip]
        for by, col in (("sample", "row_staleness"), ("token", "token_staleness")):
            d = distribution(m[col])
            dists += [{"schedule": spec.name, "by": by, "staleness": int(k), "share": v} for k, v in d.items()]
    summary = pd.DataFrame(rows)
    sync = summary.loc[summary["kind"] == "sync", "tokens_per_s"]
    if len(sync):
        summary["speedup_vs_sync"] = summary["tokens_per_s"] / float(sync.iloc[0])
    return ScheduleReplay(pd.concat(tables, ignore_index=True), summary, pd.DataFrame(dists), rec, skip)


# ---- accuracy against real runs ------------------------------------------------------------------------

ACCURACY_SCHEDULES = ("one_step_off", "async:k=1", "async:k=2", "async:k=4", "async:k=1:partial",
                      "async:k=2:partial", "async:k=4:partial")


@dataclass
class ScheduleAccuracy:
    """Predicted vs real, per schedule: throughput |error| and the staleness distributions' TV distance."""

    table: pd.DataFrame
    replayed: ScheduleReplay
    real: dict[str, pd.DataFrame]  # schedule -> its real runs' metrics (the measured updates)

    @property
    def median_abs_error(self) -> float:
        return float(self.table["abs_error"].median())

    @property
    def max_tv(self) -> float:
        return float(self.table["tv"].max())

    def __repr__(self) -> str:
        cols = ["schedule", "predicted_tokens_per_s", "real_tokens_per_s", "error", "tv", "predicted_staleness",
                "real_staleness", "predicted_step_s", "real_step_s", "predicted_trainer_idle", "real_trainer_idle",
                *[c for c in ("tv_rerun", "rerun_error", "tv_fixed", "error_fixed") if c in self.table]]
        return (f"schedule replay vs real runs: median |throughput error| {self.median_abs_error:.1%}, "
                f"max TV {self.max_tv:.3f}\n{self.table[cols].round(3).to_string(index=False)}\n"
                f"{self.replayed!r}")  # the replay's recording, fits and notes: what a failed check needs

    def _repr_html_(self) -> str:
        return f"<pre>{self!r}</pre>"


def measure(s: Any, options: dict, updates: int, skip: int, dag: Any = None, overrides: list[str] | None = None
            ) -> dict:
    """Run `updates` updates of a schedule (`ScheduleSpec.options`) for real on the session, reopened
    (same seed; `dag`: another DAG, e.g. regrouped; `overrides`: Session.reopen's); over the updates
    after `skip`: trained tokens/s, median step seconds, trainer idle share, the trained samples'
    staleness distribution, the metrics."""
    s.reopen(**({"dag": dag} if dag is not None else {}), **({"overrides": overrides} if overrides else {}),
             **options)
    train_stage = next(st.id for st in s.plan.stages if st.group == s.plan.groups[-1][0])
    m = s.run(updates, progress=False)
    m = m[m["update"] >= skip]
    it = s.items()
    trained = it[(it["stage"] == train_stage) & it["update"].isin(m["update"])]
    stale = trained["update"] - trained["version"]
    dist = stale.value_counts(normalize=True).sort_index()
    wall = float(m["wall_s"].sum())
    return {"tokens_per_s": float(trained["tokens"].sum() / wall), "step_s": float(m["wall_s"].median()),
            "trainer_idle": float(m["schedule/trainer_idle"].mean()), "dist": dist, "metrics": m}


def schedule_replay_accuracy(schedules: Iterable[Any] = ("one_step_off", "async:k=2", "async:k=2:partial"),
                             steps: int = 8, warmup: int = 2, dag=None, workers: int = 4, mode: str = "coordinator",
                             session=None, knobs: Knobs | None = None, calibrate: int = 10,
                             repeats: int = 1) -> ScheduleAccuracy:
    """Record `warmup + steps` sync updates on the synthetic long-tail DAG with worker groups
    (default: `bench.async_schedules.long_tail_dag`), replay `schedules`, run each for real
    on the same session (reopened: same seed, same batches), and compare over the `steps`
    updates after the warm-up: trained tokens/s, and the share of trained samples by staleness.
    `calibrate`: updates of one_step_off (and of async k=1 with partial rollouts, when a partial
    schedule is asked for) run first to measure the lanes' contention and the streaming engine's
    decode cost (`calibrate_lanes`; 0: none). `repeats=2` runs every schedule twice (all of them,
    then all again): the prediction is compared with the two runs pooled, and `tv_rerun` /
    `rerun_error` say how far the two real runs of one schedule are from each other, the floor
    under any prediction's error. With a measured jitter (calibrate_lanes), `tv_fixed` and
    `error_fixed` are the same recording replayed once at the model's seconds, for comparison."""
    from distflow_lab.api.session import Session
    from distflow_lab.experiments.bench.async_schedules import long_tail_dag

    specs = [s for s in parse_schedules(list(schedules)) if s.kind != "sync"]
    updates = warmup + steps
    own = session is None
    s = session or Session(dag or long_tail_dag(workers=workers), world_size=workers, mode=mode, keep_outputs=False)
    try:
        if not own or s.controller.updates:
            s.reopen(schedule="sync")
        s.run(updates, progress=False)
        rec = load_lanes(s, skip=warmup, knobs=knobs)
        if calibrate:
            rec = calibrate_lanes(s, rec, calibrate, min(warmup, calibrate - 1), any(sp.partial for sp in specs))
        predicted = replay_schedules(rec, [parse_schedule("sync"), *specs], updates=updates, skip=warmup)
        # the same recording replayed once, every call at the model's seconds: what drawing them buys
        fixed = replay_schedules(dataclasses.replace(rec, knobs=dataclasses.replace(rec.knobs, jitter=None)),
                                 specs, updates=updates, skip=warmup) if rec.knobs.jitter else None
        runs = {spec.name: [] for spec in specs}
        for _ in range(repeats):  # interleaved: a drift in the machine's speed spreads over every schedule
            for spec in specs:
                runs[spec.name].append(measure(s, spec.options, updates, warmup))
    finally:
        if own:
            s.close()
    rows = []
    p = predicted.summary.set_index("schedule")
    for spec in specs:
        r, q = _pooled(runs[spec.name]), p.loc[spec.name]
        pd_dist = predicted.staleness_of(spec.name)
        rows.append({"schedule": spec.name, "predicted_tokens_per_s": q["tokens_per_s"],
                     "real_tokens_per_s": r["tokens_per_s"], "error": q["tokens_per_s"] / r["tokens_per_s"] - 1,
                     "tv": tv_distance(pd_dist, r["dist"]), "predicted_staleness": _dist_text(pd_dist),
                     "real_staleness": _dist_text(r["dist"]), "predicted_step_s": q["step_s"],
                     "real_step_s": r["step_s"], "predicted_trainer_idle": q["trainer_idle"],
                     "real_trainer_idle": r["trainer_idle"], **_rerun(runs[spec.name]),
                     **({} if fixed is None else {
                         "tv_fixed": tv_distance(fixed.staleness_of(spec.name), r["dist"]),
                         "error_fixed": fixed.summary.set_index("schedule").at[spec.name, "tokens_per_s"]
                         / r["tokens_per_s"] - 1})})
    table = pd.DataFrame(rows)
    table["abs_error"] = table["error"].abs()
    real = {k: pd.concat([v["metrics"].assign(repeat=i) for i, v in enumerate(vs)], ignore_index=True)
            for k, vs in runs.items()}
    return ScheduleAccuracy(table, predicted, real)


def _pooled(runs: list[dict]) -> dict:
    """Repeated real runs of one schedule as one: mean tokens/s, step and idle; the staleness
    shares averaged over the runs (each run's samples weigh the same)."""
    if len(runs) == 1:
        return runs[0]
    dist = pd.concat([r["dist"] for r in runs], axis=1).fillna(0.0).mean(axis=1).sort_index()
    return {k: float(np.mean([r[k] for r in runs])) for k in ("tokens_per_s", "step_s", "trainer_idle")} | {
        "dist": dist}


def _rerun(runs: list[dict]) -> dict:
    """How far repeated real runs of one schedule are apart (the largest over pairs): TV between
    their staleness shares, and relative throughput difference. Empty for one run."""
    if len(runs) < 2:
        return {}
    pairs = [(a, b) for i, a in enumerate(runs) for b in runs[i + 1:]]
    return {"tv_rerun": max(tv_distance(a["dist"], b["dist"]) for a, b in pairs),
            "rerun_error": max(abs(a["tokens_per_s"] / b["tokens_per_s"] - 1) for a, b in pairs)}


def main(argv: list[str] | None = None) -> int:
    """python -m distflow_lab.experiments.schedule_replay --steps 24 --warmup 3 [--engine hf] [--json out.json]"""
    import argparse
    import json

    from distflow_lab.runtime.cluster import connect

    p = argparse.ArgumentParser(prog="python -m distflow_lab.experiments.schedule_replay",
                                description="schedule replay of a sync run vs real runs (synthetic long-tail DAG, or "
                                            "the tiny-cpu-longtail preset on a real engine)")
    p.add_argument("--schedules", default=",".join(ACCURACY_SCHEDULES), help="comma-separated, e.g. async:k=2:partial")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--mode", default="coordinator")
    p.add_argument("--engine", choices=("synthetic", "hf", "vllm"), default="synthetic",
                   help="hf/vllm: the tiny-cpu-longtail preset, 1 rollout + 1 train worker (bench async's session)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="for the real engines' preset")
    p.add_argument("--repeats", type=int, default=1, help="real runs per schedule (2: the reruns' own spread)")
    p.add_argument("--json", dest="json_path")
    a = p.parse_args(argv)
    connect()
    session = None
    if a.engine != "synthetic":
        from distflow_lab.experiments.bench.async_schedules import real_session

        session = real_session(a.engine, a.mode, 2, a.override)
    try:
        acc = schedule_replay_accuracy(a.schedules.split(","), steps=a.steps, warmup=a.warmup, mode=a.mode,
                                       session=session, repeats=a.repeats)
    finally:
        if session is not None:
            session.close()
    print(acc)
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({"args": vars(a), "median_abs_error": acc.median_abs_error,
                                                 "max_tv": acc.max_tv, "rows": acc.table.to_dict("records"),
                                                 "predicted": acc.replayed.summary.to_dict("records")},
                                                default=float, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
