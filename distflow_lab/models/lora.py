"""LoRA policies: the actor trains peft's adapters; a weight sync carries only the adapters.

    trainer:  W0 frozen, A [r, in] and B [out, r] trained on each target linear layer (peft,
              under FSDP2 like any other parameter: FSDP2 shards frozen and trained tensors side
              by side in one unit).
    sync:     `adapter_tensors` names each adapter by its module's HF name ("model.layers.0.
              self_attn.q_proj.lora_A"): a few MB where the whole policy is hundreds.
    rollout:  `LoraMerge` keeps its own copy of the W0 it needs (read from the model directory's
              safetensors) and loads W0 + alpha/r * B @ A into the engine, HF or vLLM, through
              the engine's ordinary `load_weights`. Merged from W0 every time, never from the
              engine's current weights: a bf16 rollout would otherwise add a rounding error per sync.

Why merged weights and not vLLM's own LoRA support: the CPU build has it (PunicaWrapperCPU), but
an adapter reaches a running engine only as a `LoRARequest` naming a directory, so each policy
version would be a write to disk and an adapter load keyed by a new id, and every request would
carry it. A merge is one matmul per layer on the reader, and the engine runs at base-model speed.

vLLM fuses q/k/v (and gate/up) into one layer and rebuilds a layer whose weights it got only in
part from uninitialised memory (its layerwise reload), so the merge sends whole layers: each
adapted module's bias too, and the untouched members of a fused group (their W0): `FUSED`.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from distflow_lab.core.config import LoraOptions
from distflow_lab.core.errors import ConfigError
from distflow_lab.models.model_dir import checkpoint_tensors

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # vLLM loads each group as one layer
_PEFT_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<which>lora_[AB])\.[^.]+\.weight$")


def apply_lora(model: torch.nn.Module, opts: LoraOptions) -> torch.nn.Module:
    """`model` wrapped by peft with adapters on `opts.target_modules`: only the adapters train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=opts.rank, lora_alpha=opts.alpha, lora_dropout=0.0, bias="none",
                        target_modules=opts.target_modules, init_lora_weights=True)  # B = 0: starts at W0
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ConfigError(f"actor.lora.target_modules={opts.target_modules!r}: {e}. The model's linear layers: "
                          f"{linears}") from None


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def adapter_name(state_name: str) -> str | None:
    """peft's state-dict name of an adapter -> its sync name ("<HF module>.lora_A"); None for the rest."""
    m = _PEFT_NAME.match(state_name)
    return f"{m['module']}.{m['which']}" if m else None


def merged_state_dict(state: dict[str, torch.Tensor], opts: LoraOptions) -> dict[str, torch.Tensor]:
    """A LoRA run's saved policy (the PeftModel's state dict: its checkpoint's actor/model.pt) as the
    base model's state dict: W0 + alpha/r * B @ A for each adapted layer, every other tensor under
    its HF name. What an evaluation or an export of a LoRA run loads."""
    ab: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if (m := _PEFT_NAME.match(name)) is not None:
            ab.setdefault(m["module"], {})[m["which"]] = t.float()
        else:
            out[name.removeprefix("base_model.model.").replace(".base_layer.", ".")] = t
    for module, d in ab.items():
        w0 = out.get(f"{module}.weight")
        if w0 is None or set(d) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA state dict: {module} has {sorted(d)} and {'no' if w0 is None else 'a'} base weight")
        out[f"{module}.weight"] = (w0.float() + opts.scale * (d["lora_B"] @ d["lora_A"])).to(w0.dtype)
    return out


class LoraMerge:
    """The rollout side: adapters in, merged HF-named weights out (see the module docstring).

    `model_dir`: the checkpoint the rollout started from (the actor's W0). Holds W0 of the layers
    a merge writes (the adapted ones and their fused siblings) after the first merge."""

    def __init__(self, model_dir: str | Path, opts: LoraOptions) -> None:
        self.where = checkpoint_tensors(model_dir)  # the checkpoint's tensors, in file order -> their file
        if not self.where:
            raise ConfigError(f"actor.lora: the rollout merges adapters into the checkpoint's own weights, and "
                              f"{model_dir} holds no model.safetensors (save it with "
                              "save_pretrained(safe_serialization=True))")
        self.scale = opts.scale
        self.base: dict[str, torch.Tensor] = {}  # W0 of the layers a merge writes

    @property
    def order(self) -> list[str]:
        """The checkpoint's tensor names, in file order."""
        return list(self.where)

    def merged(self, adapters: Iterable[tuple[str, torch.Tensor]], everything: bool = False
               ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Buckets of one merged weight each, in checkpoint order. `adapters`: (sync name, tensor),
        each copied as it arrives (a sync's views are valid only until the next one). `everything`:
        also every other tensor of the checkpoint (an engine that discarded its weights)."""
        ab: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in adapters:
            module, _, which = name.rpartition(".")
            ab.setdefault(module, {})[which] = t.detach().to(torch.float32, copy=True)
        broken = sorted(m for m, d in ab.items() if set(d) != {"lora_A", "lora_B"})
        if broken:
            raise ValueError(f"LoRA sync: {broken[:3]} arrived without both lora_A and lora_B")
        written = self._written(set(ab))
        for name in self.where if everything else [n for n in self.where if n in written]:
            w0 = self._w0(name, keep=name in written)
            d = ab.get(name.removesuffix(".weight"))
            yield [(name, w0 if d is None else (w0.float() + self.scale * (d["lora_B"] @ d["lora_A"])).to(w0.dtype))]

    def _written(self, adapted: set[str]) -> set[str]:
        """The checkpoint tensors a merge writes: every tensor (weight and bias) of each adapted
        module and of its fused siblings (vLLM rebuilds a layer it got in part from garbage)."""
        modules = set(adapted)
        for m in adapted:
            prefix, _, leaf = m.rpartition(".")
            for group in FUSED:
                if leaf in group:
                    modules |= {f"{prefix}.{sibling}" for sibling in group}
        written = {n for n in self.where if n.rpartition(".")[0] in modules}
        missing = sorted(m for m in adapted if f"{m}.weight" not in written)
        if missing:
            raise ValueError(f"LoRA sync: {missing[:3]} are not layers of the rollout's checkpoint")
        return written

    def _w0(self, name: str, keep: bool) -> torch.Tensor:
        if name in self.base:
            return self.base[name]
        from safetensors import safe_open

        with safe_open(str(self.where[name]), framework="pt") as sf:
            t = sf.get_tensor(name)
        if keep:
            self.base[name] = t
        return t
