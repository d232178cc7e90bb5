"""README's bad-input table, walked through the real CLI (`distflow-lab ...` as a
fresh process): every entry exits with status 2, prints its message as one
`error: ...` line (no traceback), and fails before Ray starts (a private
RAY_TMPDIR stays empty). The table is `experiments.bench.cli_latency.BAD_INPUTS`,
which `distflow-lab bench cli-latency` times (target < 1 s each; a benchmark,
not a test). The entries run concurrently, so the module takes about as long as
its slowest entry.
"""
from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from distflow_lab.experiments.bench.cli_latency import BAD_INPUTS, call, cli_command, expand, make_files

from .conftest import CLI

IDS = [e.name for e in BAD_INPUTS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, dict[str, subprocess.CompletedProcess]]:
    folder = make_files(tmp_path_factory.mktemp("bad-inputs"))
    ray_tmp = tmp_path_factory.mktemp("ray-tmp")  # Ray would create its session folder here
    # entries checked against the run folder or the data first: today they fail only after the heavy imports
    first = sorted(BAD_INPUTS, key=lambda e: not any(a.startswith(("--out", "--resume", "data.train")) for a in e.args))
    with ThreadPoolExecutor(max_workers=4) as pool:
        done = dict(zip([e.name for e in first],
                        pool.map(lambda e: call(e, folder, env={"RAY_TMPDIR": str(ray_tmp)}, timeout=240)[0], first)))
    return folder, ray_tmp, done


def test_the_table_uses_this_environments_cli():
    assert cli_command() == [CLI]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("entry", BAD_INPUTS, ids=IDS)
def test_bad_input_is_one_clear_error(entry, runs):
    folder, ray_tmp, done = runs
    out = done[entry.name]
    args, message = expand(entry, folder)
    said = out.stdout + out.stderr
    assert "Traceback" not in said, f"distflow-lab {' '.join(args)} printed a traceback:\n{said}"
    assert out.returncode == 2, f"distflow-lab {' '.join(args)}: exit {out.returncode}\n{said}"
    assert message in out.stderr, f"distflow-lab {' '.join(args)}: expected {message!r} in stderr:\n{out.stderr}"
    assert "error: " in out.stderr
    assert not list(ray_tmp.iterdir()), f"Ray started before the error: {list(ray_tmp.iterdir())}"


def test_overwrite_is_what_lets_an_output_be_replaced(runs):
    """With --overwrite the existing --json passes its check, and the command goes on to
    the next one (here a worker count that fails on purpose, before anything starts)."""
    folder, _, _ = runs
    out = subprocess.run([CLI, "bench", "dataplane", "--json", str(folder / "exists.json"), "--overwrite",
                          "--workers", "3"], capture_output=True, text=True, timeout=120, cwd=folder)
    assert out.returncode == 2 and "already exists" not in out.stderr and "--workers 3 cannot share" in out.stderr
