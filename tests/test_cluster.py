"""Multi-node behaviour on a `ray.cluster_utils.Cluster` (separate raylets and
object stores on one machine), and the embedded cluster's network exposure."""
from __future__ import annotations

import psutil
import pytest
import ray

from distflow_lab.runtime import cluster as lab_cluster
import distflow_lab as lab
from distflow_lab.experiments.synthetic import synthetic_grpo

from .conftest import restart_shared_ray


@pytest.fixture(scope="module")
def two_nodes(ray_cluster, tmp_path_factory):
    from ray.cluster_utils import Cluster

    lab_cluster.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "object_store_memory": 2**30,
                                                      "include_dashboard": False})
    c.add_node(num_cpus=2, object_store_memory=2**30)
    c.wait_for_nodes()
    info = lab_cluster.connect(address=c.address, log_to_driver=False)
    assert not info.started_here and len(info.nodes) == 2
    yield c
    lab_cluster.shutdown()
    c.shutdown()
    restart_shared_ray()


@pytest.mark.cluster
@pytest.mark.full
def test_one_buffer_per_node_on_its_node(two_nodes):
    dag = synthetic_grpo(batch_size=8, n=4, max_prompt_len=64, max_response_len=64, rollout_tp=2)
    s = lab.session(dag, world_size=4)
    try:
        p, plane = s.controller.placement, s.controller.plane
        assert len(set(p.worker_nodes)) == 2  # 2 CPUs per node: the workers span both nodes
        assert p.worker_nodes == sorted(p.worker_nodes, key=p.worker_nodes.index)  # node-contiguous ranks
        assert len(plane.buffers) == 2
        actual = ray.get([b.ping.remote() for b in plane.buffers])
        assert set(actual) == set(p.worker_nodes)
        # each worker talks to the buffer on its own node
        assert [actual[i] for i in plane.buffer_of_worker] == p.worker_nodes
        reports = s.controller.run(2, progress=False)
        ledger = s.ledger()
        assert (ledger["items_in"] == 32).all() and (ledger["items_out"] == 32).all()
        per_buffer = ray.get([b.ledger.remote() for b in plane.buffers])
        assert all(sum(r["items_in"] for r in rows) > 0 for rows in per_buffer)  # both nodes carried data
        assert "plan" in set(s.spans["phase"])  # consumers on two nodes: producers learn the plan, then split by node
        metrics = [r.metrics for r in reports]
        for mode in ("coordinator", "centralized"):  # the same steps, across two object stores
            s.reopen(mode=mode)
            assert [r.metrics for r in s.controller.run(2, progress=False)] == metrics, mode
    finally:
        s.close()


@pytest.mark.cluster
@pytest.mark.full
def test_one_central_buffer(two_nodes):
    dag = synthetic_grpo(batch_size=8, n=4, max_prompt_len=64, max_response_len=64, rollout_tp=2)
    s = lab.session(dag, world_size=4, num_buffers=1)
    try:
        assert len(s.controller.plane.buffers) == 1 and set(s.controller.plane.buffer_of_worker) == {0}
        s.step()
        ledger = s.ledger()
        assert (ledger["items_out"] == 32).all() and (ledger["items_in"] == 32).all()
        assert "plan" not in set(s.spans["phase"])  # one buffer for every consumer: whole outputs, no plan to wait for
    finally:
        s.close()


def test_embedded_cluster_listens_on_loopback_only(ray_cluster):
    ray_pids = {p.pid for p in psutil.process_iter(["name", "cmdline"])
                if any(k in " ".join(p.info["cmdline"] or []) for k in ("raylet", "gcs_server", "ray::", "default_worker"))}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ray_pids]
    assert listening, "expected Ray processes to listen somewhere"
    exposed = [(c.laddr.ip, c.laddr.port) for c in listening if not _loopback(c.laddr.ip)]
    assert exposed == []


def _loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)
