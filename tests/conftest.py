"""Shared fixtures. One Ray cluster for the whole session (loopback only, no
dashboard, auth disabled for this local test cluster); tests that need a
multi-node `ray.cluster_utils.Cluster` stop it and the next test that needs the
shared cluster starts it again."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray binds 127.0.0.1
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local test clusters only
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

REPO = Path(__file__).resolve().parents[1]
GSM8K_DIR = Path(os.environ.get("DISTFLOW_GSM8K_DIR", REPO.parent / "shared" / "datasets" / "gsm8k"))

_ray_tmp: dict[str, Path] = {}


def _start_shared_ray() -> None:
    import ray

    from distflow_lab import cluster

    if ray.is_initialized():
        return
    cluster.connect(num_cpus=8, include_dashboard=False, log_to_driver=False,
                    _temp_dir=str(_ray_tmp["dir"]), object_store_memory=2 * 2**30)


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
    from distflow_lab import cluster

    cluster.shutdown()


@pytest.fixture
def gsm8k_dir() -> Path:
    if not (GSM8K_DIR / "train.jsonl").exists():
        pytest.fail(f"GSM8K not found at {GSM8K_DIR}; set DISTFLOW_GSM8K_DIR")
    return GSM8K_DIR


def start_ray_head(num_cpus: int = 2) -> tuple[str, str]:
    """A separate `ray start --head` cluster (loopback) for tests that need one outside
    this process: returns (address, temp_dir). Stop it with `stop_ray_head(temp_dir)`."""
    import subprocess
    import sys
    import tempfile

    temp = tempfile.mkdtemp(prefix="dfr", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    port = 25000 + (os.getpid() * 7 + len(os.listdir("/tmp"))) % 4000
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
    import psutil

    procs = [p for p in psutil.process_iter(["cmdline"]) if temp in " ".join(p.info["cmdline"] or [])]
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=30)
