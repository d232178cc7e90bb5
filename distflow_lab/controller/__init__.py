"""Controllers: the multi-controller (DistFlow) mode and the centralized
(verl-style) baseline, side by side on the same workers and stages."""
from __future__ import annotations

from typing import Any, Callable

from ..config import ClusterOptions, SessionConfig, Switches, load_model
from ..dag import DAG
from .base import Controller
from .centralized import CentralizedController
from .distributed import DistributedController

MODES = {"distributed": DistributedController, "centralized": CentralizedController}


def create(dag: DAG, config: SessionConfig | dict | None = None, mode: str | None = None,
           engines: str | Callable | None = None, reuse: Controller | None = None, **options: Any) -> Controller:
    """Start workers for `dag`. `options` may be any switch (local_cache,
    double_buffer, balance, num_buffers) or cluster option (world_size, ...).
    `reuse`: an existing controller whose workers this one takes over when the
    placement matches (seconds saved per session; the old one is then closed)."""
    cfg = config if isinstance(config, SessionConfig) else load_model(SessionConfig, dict(config or {}))
    algo = cfg.algo  # passed through as is (a typed RunConfig must stay typed)
    data = cfg.model_dump(exclude={"algo"})
    for k, v in options.items():
        if k in Switches.model_fields:
            data["switches"][k] = v
        elif k in ClusterOptions.model_fields:
            data["cluster"][k] = v
        elif k in SessionConfig.model_fields:
            data[k] = v
        else:
            raise TypeError(f"unknown option {k!r}; switches: {list(Switches.model_fields)}, "
                            f"cluster: {list(ClusterOptions.model_fields)}")
    if mode is not None:
        data["mode"] = mode
    cfg = load_model(SessionConfig, data)
    cfg.algo = algo
    if reuse is not None and not Controller._can_reuse(cfg, reuse):
        reuse.close()  # nothing to take over: free its slots first, or a full cluster cannot place the new workers
        reuse = None
    new = MODES[cfg.mode](dag, cfg, engines=engines, reuse=reuse)
    if reuse is not None:
        reuse.close()  # frees what was not taken over
    return new


__all__ = ["Controller", "DistributedController", "CentralizedController", "create", "MODES"]
