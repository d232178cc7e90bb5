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
