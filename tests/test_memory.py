"""Driver memory against batch size: with the distributed and coordinator data planes
the driver's RSS stays flat while the batch grows 16x (it never holds a batch); with
the centralized one it grows with the batch. One session, reopened per point."""
from __future__ import annotations

import pytest

import distflow_lab as lab
from distflow_lab.experiments.bench import memory
from distflow_lab.experiments.bench.dataplane import bench_dag
from distflow_lab.observe.curves import driver_memory_figure

pytestmark = pytest.mark.full  # long-run memory: the full tier

SMALL, LARGE, CONTEXT = 16, 256, 1024  # responses per step; LARGE = 16 x SMALL


@pytest.mark.timeout(300)
def test_driver_rss_flat_in_distributed_and_coordinator_grows_in_centralized(ray_cluster, tmp_path):
    with lab.session(bench_dag(SMALL, CONTEXT, 4), world_size=4, keep_outputs=False) as s:
        df = memory.sweep_batch([SMALL, LARGE], ["distributed", "coordinator", "centralized"], context=CONTEXT,
                                workers=4, steps=1, session=s, json_path=str(tmp_path / "memory.json"),
                                progress=False)
    at = df.set_index(["mode", "batch"])
    batch_bytes = LARGE * CONTEXT * 36  # rows x tokens x bytes a token (ids, masks, log-probs, advantages)
    for mode in ("distributed", "coordinator"):
        small, large = at.loc[(mode, SMALL)], at.loc[(mode, LARGE)]
        assert large["driver_rss_growth"] < small["driver_rss_growth"] + 8 * 2**20, (mode, at)
        assert large["driver_rss_growth"] < 0.1 * batch_bytes, (mode, at)
        assert large["driver_bytes_per_step"] < 0.02 * batch_bytes, (mode, at)  # metadata only
    central = at.loc[("centralized", LARGE)]
    assert central["driver_bytes_per_step"] > 0.5 * batch_bytes  # every stage's batch passes through the driver
    assert central["driver_bytes_per_step"] > 8 * at.loc[("centralized", SMALL), "driver_bytes_per_step"]
    assert central["driver_rss_growth"] > 0.5 * batch_bytes, at
    assert central["driver_rss_growth"] > 4 * at.loc[("distributed", LARGE), "driver_rss_growth"] + 2**20
    assert (tmp_path / "memory.json").stat().st_size > 0
    fig = driver_memory_figure(df)
    assert len(fig.data) == 2 * 3 and fig.data[0].x.tolist() == [SMALL * CONTEXT, LARGE * CONTEXT]
