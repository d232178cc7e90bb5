"""The suite's two tiers and the time budget it enforces on itself (a pytest plugin).

    pytest tests            the default tier: every subsystem on real parts, <= 8 minutes on 2 cores
    pytest tests --full     everything: + learning curves, every notebook, the browser, the soak, the
                            whole algorithm x schedule x engine matrix, long-run memory, replay accuracy

A test joins the full tier with `@pytest.mark.full` (or a module's `pytestmark`). Budgets, on the
2-core machines this project runs on (CI's and a user's laptop alike):

    tier      whole run   one test   hang timeout
    default   8 min       20 s       120 s
    full      30 min      120 s      600 s

"One test" is its own setup and call time. Set-up of session- and module-scoped fixtures (a
shared cluster, a warm-started model) is shared by many tests, so it counts in the run's total,
not against the first test that happened to need it. A test that needs more carries
`@pytest.mark.budget(seconds, reason="...")`; without a reason it is a usage error.

Every test's time and tier go into the junit XML (`--junitxml`) as properties, which
`scripts/durations.py` summarises and turns into `tests/durations.json`.
`--budget-scale X` multiplies every budget (0 turns the checks off, e.g. under a debugger). By default
(`auto`) the budgets follow this machine's speed during the run, within limits: the same
2-core VM kind ran the same suite in 38 min one day and 54 min another (README, Tests), so a fixed
number would fail on a slow hour and pass on a fast one. A fixed single-thread Python workload is timed
against its time on the quiet VM the budgets were set on: 3 times at the start, then once between tests
every 2 minutes, because a shared VM's speed drifts within a run (stop 41's CI calibrated 1.27x slow at
its start and ran every test 1.5-2.2x slower than the reference run). The median of all samples gives the
scale: a slower machine gets the ratio, at most 2.5x, and a faster one never less than 1x.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Budget:
    total_s: float  # the whole run of this tier
    per_test_s: float  # one test's own setup + call
    timeout_s: float  # pytest-timeout for a test of this tier (a hang, not a slow test)


BUDGETS = {"default": Budget(total_s=8 * 60, per_test_s=20, timeout_s=120),
           "full": Budget(total_s=30 * 60, per_test_s=120, timeout_s=600)}
SHARED_SCOPES = {"session", "package", "module", "class"}
CALIBRATION_REFERENCE_S = 0.37  # calibrate() on the quiet 2-core VM the budgets were set on (2026-12-03: 0.36-0.38 s)
MAX_AUTO_SCALE = 2.5  # observed: 1.42x (2026-12-02), 1.7x (stop 41's CI), 2.5x (an idle VM, 2026-12-04)


def calibrate() -> float:
    """Seconds of a fixed single-thread CPU workload (pure Python: no BLAS threads to vary)."""
    t0 = time.perf_counter()
    acc = 0
    for i in range(6_000_000):
        acc = (acc + i * i) % 1_000_003
    return time.perf_counter() - t0


RECALIBRATE_EVERY_S = 120.0  # one more sample between tests this often (0.4-0.7 s each)


def scale_of(samples: list[float]) -> tuple[float, float]:
    """(budget scale, median calibration seconds) from calibrate() samples."""
    runs = sorted(samples)
    median = runs[len(runs) // 2]
    return min(MAX_AUTO_SCALE, max(1.0, median / CALIBRATION_REFERENCE_S)), median


def auto_scale() -> tuple[float, float]:
    """(budget scale, calibration seconds) for this machine now (median of 3)."""
    return scale_of([calibrate() for _ in range(3)])


def tier_of(item: pytest.Item) -> str:
    return "full" if item.get_closest_marker("full") else "default"


class SuiteBudget:
    def __init__(self, config: pytest.Config) -> None:
        self.full: bool = config.getoption("full")
        given = config.getoption("budget_scale")
        self.calibration_s: float | None = None
        self.samples: list[float] = []  # calibrate() seconds, when the scale is auto
        if given == "auto":
            self.samples = [calibrate() for _ in range(3)]
            self.scale, self.calibration_s = scale_of(self.samples)
        else:
            self.scale = float(given)
        self.sampled_at = time.monotonic()
        self.run = BUDGETS["full" if self.full else "default"]
        self.t0 = time.monotonic()
        self.wall_s = 0.0
        self.current: str | None = None  # the test whose setup is running
        self.shared: dict[str, float] = {}  # nodeid -> seconds of shared-fixture set-up inside its setup
        self.setup_s: dict[str, float] = {}
        self.own: dict[str, float] = {}  # nodeid -> its own setup + call seconds
        self.over: list[str] = []
        self.deselected = 0

    @property
    def enforced(self) -> bool:
        return self.scale > 0

    def limit(self, item: pytest.Item) -> tuple[float, str]:
        """(seconds, where the number comes from) for one test."""
        mark = item.get_closest_marker("budget")
        if mark is not None:
            seconds = mark.kwargs.get("seconds", mark.args[0] if mark.args else None)
            return float(seconds) * self.scale, f"its budget marker ({mark.kwargs.get('reason')})"
        return BUDGETS[tier_of(item)].per_test_s * self.scale, f"the {tier_of(item)} tier's per-test budget"

    # ---- collection: which tier runs, and each test's hang timeout -----------------------------
    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep, drop = [], []
        for item in items:
            mark = item.get_closest_marker("budget")
            if mark is not None and (not (mark.args or "seconds" in mark.kwargs) or not mark.kwargs.get("reason")):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.budget needs seconds and reason=\"why\"")
            (keep if self.full or tier_of(item) == "default" else drop).append(item)
            tier = tier_of(item)
            item.user_properties.append(("tier", tier))
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(BUDGETS[tier].timeout_s))
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
            self.deselected = len(drop)

    # ---- per test ------------------------------------------------------------------------
    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        t0 = time.monotonic()
        yield
        if fixturedef.scope in SHARED_SCOPES and self.current is not None:
            self.shared[self.current] = self.shared.get(self.current, 0.0) + time.monotonic() - t0

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        self.current = item.nodeid
        yield
        self.current = None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when == "setup":
            self.setup_s[item.nodeid] = max(0.0, call.duration - self.shared.get(item.nodeid, 0.0))
            return
        if call.when != "call":
            return
        own = self.setup_s.get(item.nodeid, 0.0) + call.duration
        self.own[item.nodeid] = own
        item.user_properties.append(("own_s", round(own, 3)))
        item.user_properties.append(("shared_setup_s", round(self.shared.get(item.nodeid, 0.0), 3)))
        if not self.enforced or not report.passed:
            return
        limit, source = self.limit(item)
        if own > limit:
            self.over.append(item.nodeid)
            report.outcome = "failed"
            report.longrepr = (f"over budget: {item.nodeid} took {own:.1f} s of its own (setup + call; shared "
                               f"fixtures excluded), over {source} of {limit:.3g} s. Make it cheaper, move it to "
                               f"the full tier (@pytest.mark.full), or give it @pytest.mark.budget(seconds, "
                               f"reason=...).")

    def pytest_runtest_logfinish(self, nodeid: str, location) -> None:
        # Between tests (nothing of ours is running): one more speed sample every RECALIBRATE_EVERY_S.
        if not self.samples or time.monotonic() - self.sampled_at < RECALIBRATE_EVERY_S:
            return
        self.samples.append(calibrate())
        self.scale, self.calibration_s = scale_of(self.samples)
        self.sampled_at = time.monotonic()

    # ---- the whole run ---------------------------------------------------------------------
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.wall_s = time.monotonic() - self.t0
        if self.enforced and self.wall_s > self.run.total_s * self.scale and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        tier = "full" if self.full else "default"
        limit = self.run.total_s * self.scale
        tr = terminalreporter
        tr.section(f"suite budget: {tier} tier")
        slow = sorted(self.own.items(), key=lambda kv: -kv[1])[:8]
        for nodeid, s in slow:
            tr.write_line(f"{s:7.1f} s  {nodeid}")
        if self.deselected:
            tr.write_line(f"{self.deselected} full-tier tests deselected (bash scripts/test.sh --full runs them)")
        speed = (f" (machine calibration {self.calibration_s:.2f} s vs {CALIBRATION_REFERENCE_S:.2f} s, median of "
                 f"{len(self.samples)} samples in {min(self.samples):.2f}-{max(self.samples):.2f} s: budgets x"
                 f"{self.scale:.2f})" if self.calibration_s is not None else f" (budgets x{self.scale:g})")
        line = (f"{tier} tier: {self.wall_s / 60:.1f} min wall ({self.wall_s:.0f} s) of a {limit / 60:.1f} min "
                f"budget{speed}; shared fixture set-up {sum(self.shared.values()):.0f} s")
        if self.enforced and self.wall_s > limit:
            tr.write_line(f"OVER BUDGET: the {line}. Find the slow tests above (or scripts/durations.py on the "
                          f"junit XML) and make them cheaper or move them to the full tier.", red=True, bold=True)
        else:
            tr.write_line(line)
        if self.over:
            tr.write_line(f"{len(self.over)} test(s) over their per-test budget: {self.over}", red=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=False,
                     help="run the full tier (default: only the default tier, under 8 minutes on 2 cores)")
    parser.addoption("--budget-scale", default="auto",
                     help="multiply every time budget: a number (0: do not enforce them), or auto (default: by this "
                          "machine's speed during the run against the reference VM's, between 1 and 2.5)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: a full-tier test (bash scripts/test.sh --full)")
    config.addinivalue_line("markers", "budget(seconds, reason): this test's own per-test time budget")
    config.pluginmanager.register(SuiteBudget(config), "distflow-suite-budget")
