"""The suite's budget hook (tests/suite_budget.py) on a small suite of its own, run by a real pytest
in a subprocess with budgets scaled down 100x (default tier: 0.2 s a test, 4.8 s a run)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import REPO

SUITE = '''
import time
import pytest

def test_quick():
    pass

def test_slow():
    time.sleep(0.6)

@pytest.mark.budget(200, reason="sleeps on purpose")
def test_slow_with_a_budget():
    time.sleep(0.6)

@pytest.mark.full
def test_full_tier_slow():
    time.sleep(0.6)   # under the full tier's 1.2 s

@pytest.fixture(scope="module")
def shared():
    time.sleep(0.6)   # shared set-up: counts in the run, not against the test

def test_uses_a_slow_shared_fixture(shared):
    pass
'''


def run_suite(folder: Path, *args: str, suite: str = SUITE) -> subprocess.CompletedProcess:
    (folder / "test_tiny.py").write_text(textwrap.dedent(suite))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.suite_budget", "-p", "no:cacheprovider",
                           "--budget-scale", "0.01", "-q", "-rA", *args, str(folder / "test_tiny.py")],
                          capture_output=True, text=True, timeout=120, cwd=folder, env=env)


def test_a_slow_test_fails_unless_it_has_a_budget_and_the_full_tier_is_opt_in(tmp_path: Path):
    out = run_suite(tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "FAILED test_tiny.py::test_slow - over budget" in text or "FAILED test_tiny.py::test_slow" in text, text
    assert "over the default tier's per-test budget of 0.2 s" in text, text
    assert "PASSED test_tiny.py::test_slow_with_a_budget" in text, text
    assert "PASSED test_tiny.py::test_uses_a_slow_shared_fixture" in text, text
    assert "1 failed, 3 passed, 1 deselected" in text, text
    assert "1 full-tier tests deselected" in text, text

    full = run_suite(tmp_path, "--full")
    assert "PASSED test_tiny.py::test_full_tier_slow" in full.stdout, full.stdout
    assert "1 failed, 4 passed" in full.stdout, full.stdout


def test_a_run_over_its_tier_budget_fails_with_a_message(tmp_path: Path):
    # 5 tests of 1 s, each under its 2 s budget: the run (> 4.8 s) is over the default tier's total
    suite = "import time, pytest\n" + "".join(
        f"@pytest.mark.budget(200, reason='long on purpose')\ndef test_{i}():\n    time.sleep(1.0)\n\n"
        for i in range(5))
    out = run_suite(tmp_path, suite=suite)
    assert "5 passed" in out.stdout, out.stdout
    assert out.returncode == 1, out.stdout
    assert "OVER BUDGET: the default tier" in out.stdout, out.stdout


def test_a_budget_marker_without_a_reason_is_a_usage_error(tmp_path: Path):
    out = run_suite(tmp_path, suite="import time, pytest\n@pytest.mark.budget(5)\ndef test_x():\n    time.sleep(0.5)\n")
    assert out.returncode != 0
    assert "needs seconds and reason" in out.stdout + out.stderr


def test_auto_budgets_follow_a_slower_machine_within_limits(monkeypatch):
    from . import suite_budget

    for seconds, scale in ((suite_budget.CALIBRATION_REFERENCE_S * 1.2, 1.2), (10.0, suite_budget.MAX_AUTO_SCALE), (0.01, 1.0)):
        monkeypatch.setattr(suite_budget, "calibrate", lambda s=seconds: s)
        assert suite_budget.auto_scale()[0] == pytest.approx(scale)
    # a machine that slows down mid-run: the samples taken between tests outvote the quick start
    ref = suite_budget.CALIBRATION_REFERENCE_S
    assert suite_budget.scale_of([ref] * 3 + [ref * 1.3] * 4) == pytest.approx((1.3, ref * 1.3))
