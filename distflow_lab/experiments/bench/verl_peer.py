"""verl's own single-controller dispatch as a third column of the data-plane
benchmark: the same synthetic stages, run by verl `Worker`s in a
`RayWorkerGroup` (CPU), with `Dispatch.DP_COMPUTE_PROTO` splitting a
`DataProto` over the workers and concatenating what they return — exactly
verl's trainer pattern, with verl's own serialization.

Optional: needs verl, installed without its pinned dependencies (they would
replace the CPU torch) by `bash scripts/install_bench.sh`. `available()` says
whether it can run.
"""
from __future__ import annotations

import os
import time

from distflow_lab.core.batch import Batch
from distflow_lab.datasets.loader import make_loader
from distflow_lab.graph.nodes import call_stage, resolve_function
from distflow_lab.graph.planner import Plan
from distflow_lab.runtime.context import stage_context


def available() -> bool:
    try:
        import verl.single_controller.ray  # noqa: F401

        return True
    except Exception:
        return False


def _worker_class():
    import torch
    from verl import DataProto
    from verl.single_controller.base import Worker
    from verl.single_controller.base.decorator import Dispatch, register

    class StageWorker(Worker):
        """Runs one distflow_lab stage function on its DataProto chunk."""

        def __init__(self, plan: Plan, seed: int, threads: int) -> None:
            super().__init__()
            torch.set_num_threads(threads)
            self.plan, self.seed = plan, seed
            self.fns = {st.id: resolve_function(st.fn, node=st.id) for st in plan.stages}

        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
        def run_stage(self, data: DataProto) -> DataProto:
            st = self.plan.stage(data.meta_info["stage"])
            step = data.meta_info["step"]
            batch = Batch(dict(data.batch.items()) if data.batch is not None else {}, data.non_tensor_batch)
            ctx = stage_context(st, batch_id=step, worker=self.rank, world_size=self.world_size,
                                session_seed=self.seed, dp_rank=self.rank, node="verl")
            t0 = time.perf_counter()
            out = call_stage(self.fns[st.id], batch, ctx)
            compute = time.perf_counter() - t0
            keep = out.changed_columns(batch) if len(out) == len(batch) else out.columns  # verl's union pattern
            tensors = {k: out.tensors[k] for k in keep if k in out.tensors}
            tensors["_compute_s"] = torch.full((len(out),), compute, dtype=torch.float64)  # max'd by the driver
            objects = {k: out.objects[k] for k in keep if k in out.objects}
            return DataProto.from_dict(tensors=tensors, non_tensors=objects or None)

    return StageWorker


def processes_per_node(world_size: int) -> list[int]:
    """verl packs each entry of `process_on_nodes` onto one node (STRICT_PACK), and
    waits forever if it cannot: fill nodes by their free CPUs, or say why not."""
    import ray

    free = sorted((int(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n["Alive"]), reverse=True)
    deadline = time.monotonic() + 30  # a just-closed session's placement group is released asynchronously
    while (avail := ray.available_resources().get("CPU", 0)) < world_size and time.monotonic() < deadline:
        time.sleep(0.5)
    if avail < world_size:
        raise RuntimeError(f"verl peer needs {world_size} free CPUs; the cluster has {avail:g} free "
                           "(close other sessions first)")
    counts, left = [], world_size
    for cpus in free:
        take = min(cpus, left)
        if take:
            counts.append(take)
            left -= take
    return counts


def measure(plan: Plan, world_size: int, steps: int, warmup: int = 1, seed: int = 0) -> list[dict]:
    """verl's dispatch over the DAG's stages (dp = world size for all, verl's default);
    one record per measured step: wall_s, compute_s, data_plane_s."""
    import ray
    from verl import DataProto
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    threads = max(1, (os.cpu_count() or 1) // world_size)
    pool = RayResourcePool(process_on_nodes=processes_per_node(world_size), use_gpu=False, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray.remote(_worker_class()), plan=plan, seed=seed, threads=threads)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")
    first = plan.stages[0]
    loaders = [make_loader(first.data, r, world_size, seed) for r in range(world_size)]
    out = []
    try:
        for step in range(warmup + steps):
            t0 = time.perf_counter()
            rows = Batch.concat([ld.next_batch() for ld in loaders])  # the driver loads the data
            data = DataProto.from_dict(tensors=dict(rows.tensors), non_tensors=dict(rows.objects))
            compute = 0.0
            for st in plan.stages[1:]:
                data.meta_info = {"stage": st.id, "step": step}
                res = wg.run_stage(data)
                compute += float(res.batch.pop("_compute_s").max())  # the slowest worker's compute
                data = res if len(res) != len(data) else data.union(res)
            wall = time.perf_counter() - t0
            if step >= warmup:
                out.append({"mode": "verl", "step": step, "wall_s": wall, "compute_s": compute,
                            "data_plane_s": max(wall - compute, 0.0)})
    finally:
        for w in wg.workers:
            ray.kill(w)
        for pg in pool.pgs or []:  # else each configuration leaks its CPUs and the next one waits forever
            ray.util.remove_placement_group(pg)
    return out
