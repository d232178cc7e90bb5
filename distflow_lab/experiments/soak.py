"""The chaos soak: a long run with real processes killed at random steps and stages,
recovered without a person, and its books checked at the end.

    report = lab.soak(mode="distributed", schedule="async", steps=40, fault_every=10, seed=0)
    report                    # faults by kind, detected, retried, resumed, lost, duplicated, hangs, latency
    distflow-lab soak --mode coordinator --schedule one_step_off --steps 500 --json soak.json

The faults (each real: a process exits, an actor is killed), drawn from a seeded generator:
    worker       a DAG worker of either group exits mid-stage
    engine       the worker that holds the rollout engine exits mid-generation (HF and vLLM,
                 VLLM_ENABLE_V1_MULTIPROCESSING=0, decode in the DAG worker's own process)
    buffer       a DataBuffer is killed as a stage starts (distributed plane)
    coordinator  the coordinator actor is killed as a stage starts (coordinator plane)
    board        the WeightBoard is killed (worker groups)
    checkpoint   a worker exits halfway through writing its part of a checkpoint

Recovery: a step whose data-plane actor died is retried by the controller; a failure
that leaves the session broken resumes from the newest complete checkpoint, at most
`max_retries` times for one step (then SoakFailed names the step and the error). Every
call is bounded by a watchdog: a call past its bound is a hang, counted, and ends the soak.

The books, from the updates the run finally kept (a resume rolls back what came after
its checkpoint): every item a generation produced is trained in its update (else lost),
no item is trained twice (duplicated), no trained row is older than max_staleness
versions (from the rows' versions), and, against an undisturbed run with the same seed,
every deterministic metric is equal (sync and one_step_off: required; async k >= 2:
reported, its pacing follows timing).
"""
from __future__ import annotations

import html
import json
import re
import shutil
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from distflow_lab.core.config import SCHEDULES, ConfigError, ScheduleOptions, check_schedule
from distflow_lab.core.errors import FriendlyError
from distflow_lab.runtime import faults as chaos
from distflow_lab.runtime.checkpoint_files import latest_checkpoint

KINDS = ("worker", "engine", "buffer", "coordinator", "board", "checkpoint", "sync_corrupt", "sync_publisher")
ENGINES = ("synthetic", "hf", "vllm")
# metrics that follow the clock, not the data: left out of the comparison with the undisturbed run
TIMING = re.compile(r"idle|queued|time|seconds|throughput|per_s|_s$|_s/|rss|memory|weight_sync")


class SoakFailed(FriendlyError, RuntimeError):
    """A step failed more than max_retries times: the soak cannot recover it."""


@dataclass
class Fault:
    step: int  # the step (batch) it strikes in; a checkpoint fault: the updates done when the save starts
    kind: str
    worker: int  # the worker that dies, or that kills the actor
    stage: str
    actor: int = 0
    mark: str = ""
    fired_at: float | None = None
    detected_at: float | None = None
    error: str = ""  # the named error it surfaced as ('retried' for a controller retry)

    @property
    def latency_s(self) -> float | None:
        if self.fired_at is None or self.detected_at is None:
            return None
        return max(0.0, self.detected_at - self.fired_at)


@dataclass
class Update:
    """What the soak keeps of one training update."""

    batch: int
    produced: list[int]  # item ids out of the generation stage
    trained: list[int]  # item ids out of the last training stage
    versions: list[int]  # the trained rows' policy versions (oldest token), -1 where untagged
    metrics: dict[str, float]


@dataclass
class SoakReport:
    mode: str
    schedule: str
    engine: str
    steps: int
    fault_every: float
    seed: int
    max_staleness: int
    faults: list[Fault] = field(default_factory=list)
    steps_retried: int = 0
    resumes: int = 0
    named_errors: dict[str, int] = field(default_factory=dict)
    raw_exceptions: list[str] = field(default_factory=list)
    hangs: int = 0
    items_trained: int = 0
    items_lost: int = 0
    items_duplicated: int = 0
    batches_dropped: int = 0
    staleness_max: int = 0
    staleness_ok: bool = True
    metrics_equal: bool | None = None  # against the undisturbed run (None: not compared)
    metric_diffs: list[str] = field(default_factory=list)
    deterministic: bool = True  # whether the schedule's metrics must equal the undisturbed run's
    stopped: str = ""  # why the soak ended early (a hang, SoakFailed), else ""
    wall_s: float = 0.0

    # ---- the figures ----------------------------------------------------------------
    @property
    def injected(self) -> dict[str, int]:
        return dict(Counter(f.kind for f in self.faults if f.fired_at is not None))

    @property
    def detected(self) -> int:
        return sum(f.detected_at is not None for f in self.faults if f.fired_at is not None)

    def latency(self) -> dict[str, float | None]:
        xs = [f.latency_s for f in self.faults if f.latency_s is not None]
        return {"p50": float(np.median(xs)) if xs else None, "max": float(max(xs)) if xs else None}

    @property
    def ok(self) -> bool:
        """Nothing lost or duplicated, no raw exception, no hang, every fault detected, the
        staleness bound kept and (where the schedule is deterministic) the undisturbed run's metrics."""
        return (not self.items_lost and not self.items_duplicated and not self.raw_exceptions and not self.hangs
                and not self.stopped and self.staleness_ok and self.detected == sum(self.injected.values())
                and (self.metrics_equal is not False or not self.deterministic))

    def summary(self) -> dict[str, Any]:
        lat = self.latency()
        return {"mode": self.mode, "schedule": self.schedule, "engine": self.engine, "steps": self.steps,
                "faults": sum(self.injected.values()), "by_kind": self.injected, "detected": self.detected,
                "steps_retried": self.steps_retried, "resumes": self.resumes, "named_errors": self.named_errors,
                "raw_exceptions": len(self.raw_exceptions), "hangs": self.hangs, "items_trained": self.items_trained,
                "items_lost": self.items_lost, "items_duplicated": self.items_duplicated,
                "batches_dropped": self.batches_dropped, "staleness_max": self.staleness_max,
                "staleness_ok": self.staleness_ok, "metrics_equal": self.metrics_equal,
                "detect_p50_s": lat["p50"], "detect_max_s": lat["max"], "wall_s": round(self.wall_s, 1),
                "ok": self.ok, "stopped": self.stopped}

    def to_dict(self) -> dict[str, Any]:
        d = {**self.summary(), **{k: v for k, v in asdict(self).items() if k not in ("faults",)}}
        d["faults"] = [{**asdict(f), "latency_s": f.latency_s} for f in self.faults]
        return d

    def table(self) -> pd.DataFrame:
        s = self.summary()
        rows = [(k, ", ".join(f"{a}: {b}" for a, b in v.items()) if isinstance(v, dict) else v) for k, v in s.items()]
        return pd.DataFrame(rows, columns=["figure", "value"])

    def __repr__(self) -> str:
        return f"SoakReport({self.mode}, {self.schedule}, {self.engine}):\n" + self.table().to_string(index=False)

    def _repr_html_(self) -> str:
        colour = "#27ae60" if self.ok else "#c0392b"
        return (f"<div style='border-left:4px solid {colour};padding:4px 8px'><b>soak {html.escape(self.mode)} / "
                f"{html.escape(self.schedule)} / {html.escape(self.engine)}: {'ok' if self.ok else 'NOT ok'}</b>"
                + self.table().to_html(index=False) + "</div>")


# ---- the session under test -----------------------------------------------------------------
def open_soak_session(mode: str, schedule: str, engine: str, seed: int, max_staleness: int,
                      stage_timeout_s: float, overrides: list[str] = (), partial_rollout: bool = False) -> Any:
    """The run the soak drives: the synthetic GRPO DAG (2 workers), or the tiny GRPO on the
    HF or vLLM engine; colocated for sync, on two groups of one worker for the others."""
    from distflow_lab.api.runner import load_run_config, open_session
    from distflow_lab.api.session import Session
    from distflow_lab.experiments.synthetic import synthetic_grpo

    # its faults kill processes: the run starts its own workers (never the worker pool's) and ends them
    opts: dict[str, Any] = {"mode": mode, "schedule": schedule, "seed": seed, "stage_timeout_s": stage_timeout_s,
                            "fresh_workers": True}
    facts = SCHEDULES[schedule]
    if facts.partial_rollout:  # it takes a staleness bound of the run's own
        opts.update(max_staleness=max_staleness, partial_rollout=partial_rollout)
    groups = {"rollout": 1, "train": 1} if facts.needs_groups else None
    if engine == "synthetic":
        dag = synthetic_grpo(batch_size=8, n=4, max_prompt_len=32, max_response_len=32, groups=groups,
                             rollout_tp=1 if groups else 2)
        return Session(dag, world_size=2, **opts)
    more = [f"rollout.engine={engine}", "trainer.checkpoint_every=0", *overrides]
    if groups:
        more.append("groups={rollout: 1, train: 1}")
    return open_session(load_run_config("tiny-cpu-grpo", more), progress=False, **opts)


# ---- the chaos plan -----------------------------------------------------------------------
def kinds_for(mode: str, schedule: str) -> list[str]:
    """The faults a configuration has targets for."""
    out = ["worker", "engine", "checkpoint"]
    if mode == "distributed":
        out.append("buffer")
    if mode == "coordinator":
        out.append("coordinator")
    if SCHEDULES[schedule].needs_groups:  # weights travel between groups
        out += ["board", "sync_corrupt", "sync_publisher"]
    return out


def plan_faults(controller: Any, steps: int, fault_every: float, seed: int, checkpoint_every: int,
                workdir: Path) -> list[Fault]:
    """At most one fault per step, with probability 1/fault_every, its kind, worker and
    stage drawn from a generator seeded by (seed, step): the same plan for the same seed."""
    if fault_every <= 0:
        return []
    plan = controller.plan
    work = [st for st in plan.stages if st.type != "data_load"]
    through_plane = [st for st in work if (e := plan.edge_into(st.index)) is not None and e.kind != "local"]
    targets = {"worker": work, "engine": [st for st in work if st.type == "generate"], "buffer": through_plane,
               "coordinator": through_plane, "board": [st for st in work if st.type == "train"], "checkpoint": [None],
               # the publisher: the first rank of the training segment's last stage, which publishes after it
               "sync_corrupt": work[-1:], "sync_publisher": work[-1:]}
    # a kind with no stage to strike at (e.g. a plane whose edges are all local caches) is left out
    kinds = [k for k in kinds_for(controller.mode, controller.config.schedule.kind) if targets[k]]
    out = []
    for step in range(1, steps):
        rng = np.random.default_rng([seed, step])
        if rng.random() >= 1.0 / fault_every:
            continue
        kind = str(rng.choice(kinds))
        pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
        if kind == "checkpoint":  # the next save at or after this step
            at = -(-step // checkpoint_every) * checkpoint_every
            if at >= steps:
                continue
            out.append(Fault(at, kind, int(rng.integers(len(controller.workers))), "save_checkpoint"))
            continue
        st = pick(targets[kind])
        actor = int(rng.integers(len(controller.plane.actors()))) if kind in ("buffer", "coordinator") else 0
        worker = st.ranks[0] if kind.startswith("sync_") else int(pick(list(st.ranks)))
        out.append(Fault(step, kind, int(worker), st.id, actor))
    for i, f in enumerate(out):
        f.mark = str(workdir / f"fault-{i:04d}.fired")
    return out


def arm(session: Any, plan: list[Fault], from_step: int) -> None:
    """Give the (new) workers every planned fault that has not struck yet."""
    for f in plan:
        if f.step < from_step or Path(f.mark).exists():
            continue
        target = {"engine": "worker"}.get(f.kind, f.kind)
        index = f.actor if target in ("buffer", "coordinator") else f.worker
        chaos.inject(session, target, index, batch_id=f.step, stage=f.stage, by_worker=f.worker, mark=f.mark)


def _fired(plan: list[Fault]) -> list[Fault]:
    """Faults that struck (their mark file is there) and are not yet detected."""
    out = []
    for f in plan:
        if f.fired_at is None and Path(f.mark).exists():
            f.fired_at = float(Path(f.mark).read_text() or "nan")
        if f.fired_at is not None and f.detected_at is None:
            out.append(f)
    return out


# ---- the books ------------------------------------------------------------------------------
def _ids(report: Any, types: dict[str, str], kind: str, first: bool) -> tuple[list[int], list[int]]:
    """Item ids (and their rows' versions) out of the first or last stage of type `kind`."""
    stages = [st for st in report.stages if st.results and types.get(st.stage_id) == kind]
    if not stages:
        return [], []
    st = stages[0] if first else stages[-1]
    ids = [int(x) for r in st.results if r.item_ids is not None for x in r.item_ids]
    vs = [int(x) for r in st.results if r.item_ids is not None
          for x in (r.item_versions if r.item_versions is not None else [-1] * len(r.item_ids))]
    return ids, vs


def keep_update(report: Any, types: dict[str, str]) -> Update:
    """`types`: stage id -> node type (generate, train, ...)."""
    produced, _ = _ids(report, types, "generate", first=True)
    trained, versions = _ids(report, types, "train", first=False)
    m = {k: float(v) for k, v in report.metrics.items() if not TIMING.search(k)}
    return Update(int(report.metrics.get("schedule/batch", report.update)), produced, trained, versions, m)


def audit(r: SoakReport, kept: dict[int, Update], k: int | None) -> None:
    """Fill the report's books from the updates the run kept."""
    counts = Counter(i for u in kept.values() for i in u.trained)
    r.items_trained = sum(counts.values())
    r.items_duplicated = sum(c - 1 for c in counts.values() if c > 1)
    r.items_lost = sum(len(set(u.produced) - set(u.trained)) for u in kept.values())
    batches = sorted(u.batch for u in kept.values())
    r.batches_dropped = int(max((u.metrics.get("schedule/dropped_batches", 0) for u in kept.values()), default=0))
    gaps = len(set(range(batches[-1] + 1)) - set(batches)) if batches else 0
    rows = max((len(u.produced) for u in kept.values()), default=0)
    r.items_lost += max(0, gaps - r.batches_dropped) * rows  # a batch neither trained nor counted as dropped
    r.items_duplicated += (len(batches) - len(set(batches))) * rows  # a batch trained in two updates
    ages = [t - v for t, u in kept.items() for v in u.versions if v >= 0]
    r.staleness_max = int(max(ages, default=0))
    r.staleness_ok = k is None or r.staleness_max <= k


def compare(r: SoakReport, kept: dict[int, Update], base: dict[int, Update]) -> None:
    diffs = []
    for t in sorted(set(kept) | set(base)):
        a, b = base.get(t), kept.get(t)
        if a is None or b is None:
            diffs.append(f"step {t}: {'missing in the soak' if b is None else 'missing in the undisturbed run'}")
            continue
        for key in sorted(set(a.metrics) | set(b.metrics)):
            x, y = a.metrics.get(key), b.metrics.get(key)
            if x != y and not (x is not None and y is not None and np.isnan(x) and np.isnan(y)):
                diffs.append(f"step {t} {key}: undisturbed {x} vs soak {y}")
    r.metrics_equal, r.metric_diffs = not diffs, diffs[:20]


# ---- the loop -------------------------------------------------------------------------------
class _Hang(Exception):
    pass


def _bounded(pool: ThreadPoolExecutor, fn: Callable[[], Any], limit_s: float, what: str) -> Any:
    """fn() on the watchdog's thread; past limit_s it is a hang."""
    fut = pool.submit(fn)
    try:
        return fut.result(timeout=limit_s)
    except FutureTimeout:
        raise _Hang(f"{what} did not return within {limit_s:.0f}s") from None


def drive(session: Any, r: SoakReport, steps: int, plan: list[Fault], root: Path, checkpoint_every: int,
          max_retries: int, progress: bool) -> dict[int, Update]:
    """Run `steps` updates through the faults of `plan`; returns the updates kept."""
    c = session.controller
    types = {st.id: st.type for st in c.plan.stages}
    timeout = c.config.cluster.stage_timeout_s
    step_limit = sum(st.timeout_s or timeout for st in c.plan.stages) * 2 + 60
    setup_limit = 8 * timeout + 120
    kept: dict[int, Update] = {}
    attempts: Counter = Counter()
    seen_retries = 0
    pool = ThreadPoolExecutor(1, thread_name_prefix="soak")
    bar = tqdm(total=steps, desc=f"soak {r.mode}/{r.schedule}", disable=not progress, leave=False)

    def save(n: int) -> None:
        _bounded(pool, lambda: session.save_checkpoint(root / f"step{n:06d}"), setup_limit, f"checkpoint {n}")
        for old in sorted(root.glob("step*"))[:-2]:  # the newest two are enough
            shutil.rmtree(old, ignore_errors=True)

    try:
        save(0)
        arm(session, plan, 0)
        while c.updates < steps:
            t = c.updates
            try:
                rep = _bounded(pool, session.step, step_limit, f"step {t}")
                kept[rep.update] = keep_update(rep, types)
                bar.n = len(kept)
                bar.refresh()
                if (rep.update + 1) % checkpoint_every == 0 and rep.update + 1 < steps:
                    save(rep.update + 1)
            except _Hang:
                raise
            except Exception as e:  # noqa: BLE001 - a named error is recovered; a raw one is also counted
                name = type(e).__name__
                if isinstance(e, FriendlyError):
                    r.named_errors[name] = r.named_errors.get(name, 0) + 1
                    now = time.time()
                    for f in _fired(plan):
                        f.detected_at, f.error = now, name
                else:
                    r.raw_exceptions.append(f"step {t}: {name}: {str(e)[:300]}")
                attempts[t] += 1
                if attempts[t] > max_retries:
                    raise SoakFailed(f"soak {r.mode}/{r.schedule}: step {t} failed {attempts[t]} times; the last: "
                                     f"{name}: {getattr(e, 'summary', e)}") from None
                if c.broken or c.placement is None or not isinstance(e, FriendlyError):
                    _resume(session, r, kept, root, pool, setup_limit, max_retries)
                    arm(session, plan, c.updates)
                else:
                    r.steps_retried += 1
            for x in c.retries[seen_retries:]:  # steps the controller retried itself (a data-plane actor died)
                r.steps_retried += 1
                for f in _fired(plan):
                    if f.fired_at <= x["detected_at"]:
                        f.detected_at, f.error = x["detected_at"], "retried"
            seen_retries = len(c.retries)
    except _Hang as e:
        r.hangs += 1
        r.stopped = str(e)
    except SoakFailed as e:
        r.stopped = str(e)
    finally:
        bar.close()
        _fired(plan)
        pool.shutdown(wait=False, cancel_futures=True)
    return kept


def _resume(session: Any, r: SoakReport, kept: dict[int, Update], root: Path, pool: ThreadPoolExecutor,
            limit_s: float, max_retries: int) -> None:
    """Restart every worker from the newest complete checkpoint (a resume that fails is tried
    again, at most max_retries times)."""
    ckpt = latest_checkpoint(root)
    if ckpt is None:
        raise SoakFailed(f"no complete checkpoint under {root} to resume from")
    for attempt in range(max_retries + 1):
        try:
            start = _bounded(pool, lambda: session.resume(ckpt), limit_s, f"resume from {ckpt.name}")
            break
        except FriendlyError as e:
            r.named_errors[type(e).__name__] = r.named_errors.get(type(e).__name__, 0) + 1
            if attempt == max_retries:
                raise SoakFailed(f"resume from {ckpt} failed {attempt + 1} times; the last: {type(e).__name__}: "
                                 f"{getattr(e, 'summary', e)}") from None
    for t in [t for t in kept if t >= start]:  # rolled back: these updates run again
        del kept[t]
    r.resumes += 1


def soak(mode: str = "distributed", schedule: str = "sync", engine: str = "synthetic", steps: int = 40,
         fault_every: float = 10.0, seed: int = 0, max_staleness: int = 2, checkpoint_every: int = 5,
         max_retries: int = 3, compare_undisturbed: bool = True, stage_timeout_s: float = 30.0,
         overrides: list[str] = (), progress: bool = True, workdir: str | Path | None = None,
         partial_rollout: bool = False) -> SoakReport:
    """A chaos soak of one configuration (see the module's docstring); returns its report."""
    check(mode, schedule, engine, steps, fault_every, checkpoint_every, partial_rollout)
    facts = SCHEDULES[schedule]
    k = facts.bound(max_staleness)
    r = SoakReport(mode, schedule, engine, steps, fault_every, seed, k,  # a fixed bound (or k = 0): sync order
                   deterministic=(facts.staleness is not None or k == 0) and not partial_rollout)
    base_dir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="soak-"))
    t0 = time.time()
    runs = [("undisturbed", 0.0)] if compare_undisturbed else []
    books = {}
    for name, every in [*runs, ("soak", fault_every)]:
        root = base_dir / name
        shutil.rmtree(root, ignore_errors=True)
        (root / "checkpoints").mkdir(parents=True)
        run = r if name == "soak" else SoakReport(mode, schedule, engine, steps, 0, seed, k)
        session = open_soak_session(mode, schedule, engine, seed, k, stage_timeout_s, list(overrides),
                                    partial_rollout)
        try:
            plan = plan_faults(session.controller, steps, every, seed, checkpoint_every, root)
            if name == "soak":
                r.faults = plan
            books[name] = drive(session, run, steps, plan, root / "checkpoints", checkpoint_every, max_retries,
                                progress)
        finally:
            session.close()
        if name == "undisturbed" and (run.stopped or run.raw_exceptions):
            raise SoakFailed(f"the undisturbed run failed: {run.stopped or run.raw_exceptions[0]}")
    audit(r, books["soak"], k if facts.needs_groups else None)
    if compare_undisturbed:
        compare(r, books["soak"], books["undisturbed"])
    r.wall_s = time.time() - t0
    if workdir is None:
        shutil.rmtree(base_dir, ignore_errors=True)
    return r


def check(mode: str, schedule: str, engine: str, steps: int, fault_every: float, checkpoint_every: int,
          partial_rollout: bool = False) -> None:
    """Bad arguments, named before anything starts."""
    from distflow_lab.core.config import MODES

    if mode not in MODES:
        raise ConfigError(f"soak: mode {mode!r} is not one of {list(MODES)}")
    if schedule not in SCHEDULES:
        raise ConfigError(f"soak: schedule {schedule!r} is not one of {list(SCHEDULES)}")
    if engine not in ENGINES:
        raise ConfigError(f"soak: engine {engine!r} is not one of {list(ENGINES)}")
    check_schedule(mode, ScheduleOptions(kind=schedule))  # the centralized plane cannot overlap steps
    if partial_rollout and not SCHEDULES[schedule].partial_rollout:
        takes = " or ".join(repr(n) for n, f in SCHEDULES.items() if f.partial_rollout)
        raise ConfigError(f"soak: partial rollouts run under schedule {takes} only, not {schedule!r}")
    if steps < 2 or checkpoint_every < 1 or fault_every < 0:
        raise ConfigError(f"soak: steps must be >= 2 (got {steps}), checkpoint_every >= 1 (got {checkpoint_every}), "
                          f"fault_every >= 0 (got {fault_every})")


def run(modes: list[str], schedules: list[str], engines: list[str], steps: int, fault_every: float, seed: int,
        json_path: str | None, max_staleness: int = 2, overrides: list[str] = ()) -> list[dict]:
    """`distflow-lab soak`: every (mode, schedule, engine) given that can run; prints the table.
    The JSON is rewritten after every configuration, so a long soak stopped early keeps what it ran."""
    from distflow_lab.experiments.bench.common import print_table, write_json

    reports, summaries = [], []  # the JSON keeps every fault; the table shows the counts
    for engine in engines:
        for schedule in schedules:
            for mode in modes:
                if SCHEDULES[schedule].needs_groups and mode == "centralized":
                    continue  # the centralized plane cannot overlap steps
                rep = soak(mode, schedule, engine, steps, fault_every, seed, max_staleness,
                           overrides=overrides if engine != "synthetic" else ())
                reports.append({**rep.to_dict(), "overrides": list(overrides) if engine != "synthetic" else []})
                summaries.append(rep.summary())
                print(rep, flush=True)
                write_json(reports, json_path)
    cols = ["mode", "schedule", "engine", "steps", "faults", "detected", "steps_retried", "resumes", "raw_exceptions",
            "hangs", "items_lost", "items_duplicated", "staleness_max", "metrics_equal", "detect_p50_s",
            "detect_max_s", "wall_s", "ok"]
    print_table(summaries, cols, title="chaos soak")
    if not all(x["ok"] for x in reports):
        print("NOT ok: " + json.dumps([{k: x[k] for k in ("mode", "schedule", "engine", "stopped")}
                                       for x in reports if not x["ok"]]))
    return reports
