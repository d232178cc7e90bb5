"""Shared fixtures.

- The two tiers and the time budget: `suite_budget.py` (a plugin: `pytest --full`).
- One Ray cluster for the whole session (loopback only, no dashboard, auth disabled for this
  local test cluster); tests that need a multi-node `ray.cluster_utils.Cluster` stop it and the
  next test that needs the shared cluster starts it again. Notebook kernels and CLI subprocesses
  attach to it (`suite_env()`: RAY_ADDRESS).
- One model home for the whole session: $DISTFLOW_HOME is a temporary folder (or
  $DISTFLOW_TEST_HOME, kept between runs), and so is the XDG cache, so nothing here reads or
  writes the user's ~/.cache. The tiny models and their SFT warm starts are built there once
  (`grpo_model`, `calculator_model`, `guess_number_model`), and every test, kernel and CLI
  subprocess that uses the default `model.path` finds them.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from .suite_budget import pytest_addoption, pytest_configure  # noqa: F401  (the tiers and their budgets)

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray binds 127.0.0.1
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test clusters only
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("DISTFLOW_WORKER_POOL", "3")  # the suite alternates a few worker shapes: keep three parked

KEEP_HOME = bool(os.environ.get("DISTFLOW_TEST_HOME"))
SUITE_HOME = Path(os.environ.get("DISTFLOW_TEST_HOME") or tempfile.mkdtemp(prefix="distflow-suite-")).resolve()
os.environ["DISTFLOW_HOME"] = str(SUITE_HOME)  # models, warm starts, generated data: never ~/.cache/distflow_lab
os.environ["XDG_CACHE_HOME"] = str(SUITE_HOME / "xdg-cache")  # HF, vLLM, torch, W&B caches: never ~/.cache

REPO = Path(__file__).resolve().parents[1]
CLI = os.path.join(os.path.dirname(sys.executable), "distflow-lab")  # the console script of this venv
GSM8K_DIR = Path(os.environ.get("DISTFLOW_GSM8K_DIR", REPO.parent / "shared" / "datasets" / "gsm8k"))

_ray_tmp: dict[str, Path] = {}


def _start_shared_ray() -> None:
    import ray

    from distflow_lab.runtime import cluster

    if ray.is_initialized():
        return
    cluster.connect(num_cpus=8, include_dashboard=False, log_to_driver=False,
                    _temp_dir=str(_ray_tmp["dir"]), object_store_memory=2 * 2**30)
    _ray_tmp["address"] = ray.get_runtime_context().gcs_address


def suite_env(**extra: str) -> dict[str, str]:
    """The environment for a notebook kernel or CLI subprocess: this process's (the suite's model
    home), attached to the shared cluster when it runs (no cluster start of its own)."""
    import ray

    env = {**os.environ, **extra}
    if ray.is_initialized() and _ray_tmp.get("address") == ray.get_runtime_context().gcs_address:
        env["RAY_ADDRESS"] = _ray_tmp["address"]
    return env


@pytest.fixture(scope="session")
def _ray_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ray")
    _ray_tmp["dir"] = d
    return d


@pytest.fixture(scope="session")
def ray_cluster(_ray_dir):
    """The shared single-node Ray cluster (8 logical CPUs on 2 cores). A test
    that replaces it (multi-node) must call `restart_shared_ray()` when done."""
    _start_shared_ray()
    import ray

    yield ray


def restart_shared_ray() -> None:
    _start_shared_ray()


@pytest.fixture(scope="session", autouse=True)
def _shutdown_ray_at_end():
    yield
    from distflow_lab.runtime import cluster

    cluster.shutdown()
    if not KEEP_HOME:
        shutil.rmtree(SUITE_HOME, ignore_errors=True)


def _prepared(preset: str, *overrides: str) -> str:
    """Build `preset`'s tiny model and SFT warm start in the suite's home (once per run: later
    calls find them cached); the warm-started model's path."""
    from distflow_lab.api.runner import load_run_config, prepare

    cfg, _ = prepare(load_run_config(preset, list(overrides)), progress=False)
    return cfg.model.path


@pytest.fixture(scope="session")
def grpo_model() -> str:
    """tiny-cpu-grpo's warm-started model (the default model.path of the tiny presets)."""
    return _prepared("tiny-cpu-grpo")


VLLM_EAGER = "rollout.vllm.enforce_eager=true"  # a test engine builds in ~5 s, not ~16 (tests/test_vllm.py compiles)
CALCULATOR_WARM_START = "model.warm_start.steps=1000"  # the preset's 1,500 take ~50 s; 1,000 (~35 s) learn as clearly


@pytest.fixture(scope="session")
def calculator_model() -> str:
    """tiny-cpu-calculator's tool-use warm start, shortened for the suite (tests pass CALCULATOR_WARM_START)."""
    return _prepared("tiny-cpu-calculator", CALCULATOR_WARM_START)


GUESS_NUMBER_WARM_START = "model.warm_start.steps=300"


@pytest.fixture(scope="session")
def guess_number_model() -> str:
    """tiny-cpu-guess-number's warm start."""
    return _prepared("tiny-cpu-guess-number", GUESS_NUMBER_WARM_START)


@pytest.fixture
def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "train.jsonl").exists():
        pytest.fail(f"GSM8K not found at {GSM8K_DIR}; set DISTFLOW_GSM8K_DIR")
    return GSM8K_DIR


def run_python(code: str, timeout: int = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -c code` (dedented) in a fresh process with this interpreter; env adds to os.environ."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def free_port() -> int:
    """A TCP port free on loopback right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def procs_matching(marker: str) -> list:
    """Processes with `marker` (e.g. a private temp dir) in one of their arguments."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in a for a in (p.info["cmdline"] or [])):
                found.append(p)
        except psutil.Error:
            pass
    return found


def reap(procs: list, grace_s: float = 0.0) -> None:
    """SIGTERM `procs`, give them `grace_s` to exit, SIGKILL the rest (grace 0: SIGKILL at once)."""
    import psutil

    def signal_all(ps: list, how) -> None:
        for p in ps:
            try:
                how(p)
            except psutil.Error:  # already gone
                pass

    if grace_s > 0:
        signal_all(procs, psutil.Process.terminate)
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
    signal_all(procs, psutil.Process.kill)
    psutil.wait_procs(procs, timeout=30)


def start_ray_head(num_cpus: int = 2) -> tuple[str, str]:
    """A separate `ray start --head` cluster (loopback) for tests that need one outside
    this process: returns (address, temp_dir). Stop it with `stop_ray_head(temp_dir)`."""
    import tempfile

    temp = tempfile.mkdtemp(prefix="dfr", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    port = free_port()
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ["PATH"]}
    out = subprocess.run([os.path.join(bindir, "ray"), "start", "--head", f"--port={port}", f"--num-cpus={num_cpus}",
                          "--include-dashboard=false", f"--temp-dir={temp}"], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return f"127.0.0.1:{port}", temp


def stop_ray_head(temp: str) -> None:
    """Kill only the processes of the cluster under `temp` (`ray stop` would kill every
    Ray process on the machine, this test session's own cluster included)."""
    reap(procs_matching(temp))


@pytest.fixture(scope="module")
def one_torch_thread():
    """2 shared cores: multi-threaded BLAS on tiny matmuls is ~100x slower under contention."""
    import torch

    n, _ = torch.get_num_threads(), torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    """The tiny models' character tokenizer."""
    from distflow_lab.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()
