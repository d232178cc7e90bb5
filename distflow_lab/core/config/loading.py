"""Loading configs: YAML read safely, CLI-style `a.b=value` overrides parsed as YAML scalars,
and validation errors that name every bad key as the user wrote it and where it came from
(the file, or the override at fault)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from distflow_lab.core.config.run import RunConfig
from distflow_lab.core.errors import ConfigError


def set_dotted(d: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    for k in keys[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ConfigError(f"override {dotted!r}: {k!r} is not a section")
    d[keys[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """`a.b=value` strings -> {"a.b": value} (values parsed as YAML scalars: 3, true, [1,2], null)."""
    out: dict[str, Any] = {}
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r} must look like key.path=value")
        key, raw = o.split("=", 1)
        try:
            out[key.strip()] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {o!r}: the value is not valid YAML ({e.problem})") from None
    return out


def flat_sections(cls: type | None) -> dict[str, str]:
    """{key: section} for the keys `cls` also takes at its top level though they belong to one of its
    sections (a RunConfig's `mode`, `cluster`, ... are its `session`'s; `RunConfig.flat_keys`)."""
    return {k: section for section, keys in getattr(cls, "flat_keys", {}).items() for k in keys}


def canonical_key(key: str, flat: dict[str, str]) -> str:
    """A dotted key as a user writes it: `session.cluster.world_size` -> `cluster.world_size`."""
    first, _, rest = key.partition(".")
    return rest if rest and flat.get(rest.partition(".")[0]) == first else key


def placed_key(data: dict, key: str, flat: dict[str, str]) -> str:
    """Where an override goes in `data`: where the file already wrote that key, flat or in its section
    (an override replaces a value; it never makes the same key appear twice)."""
    first = key.partition(".")[0]
    short = canonical_key(key, flat)
    head = short.partition(".")[0]
    section = flat.get(head)
    if section is None:
        return key
    in_section = isinstance(data.get(section), dict) and head in data[section]
    if first == section and head in data and not in_section:
        return short
    if first != section and head not in data and in_section:
        return f"{section}.{key}"
    return key


def apply_overrides(data: dict, overrides: list[str], cls: type | None = None) -> dict:
    """Set each `a.b=value` in `data` (in place). With `cls`, a key it takes both flat and in a section
    is set where `data` already has it."""
    flat = flat_sections(cls)
    for key, value in parse_overrides(overrides).items():
        set_dotted(data, placed_key(data, key, flat), value)
    return data


def load_model(cls: type[BaseModel], data: dict, source: str = "<config>", overrides: list[str] | None = None) -> Any:
    """Validate `data` as `cls`; errors name every bad key, what is wrong with it, and
    whether it came from an override (`--set`-style `a.b=value`) or from `source`."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        flat = flat_sections(cls)
        given = {canonical_key(k.split("=", 1)[0].strip(), flat): k for k in overrides or []}
        lines = []
        for err in e.errors():
            loc = [str(p) for p in err["loc"]]
            if len(loc) > 1 and flat.get(loc[1]) == loc[0] and isinstance(data, dict) and loc[1] in data:
                loc = loc[1:]  # written flat (`mode: x`): named as written, not as `session.mode`
            key = ".".join(loc)
            what = "unknown key (not a field of this section)" if err["type"] == "extra_forbidden" else err["msg"]
            short = canonical_key(key, flat)
            origin = next((f" (from the override {o!r})" for k, o in given.items()
                           if short == k or short.startswith(k + ".") or k.startswith(short + ".")), "")
            if not key:  # a check across sections: its message names the keys
                lines.append(f"  {what.removeprefix('Value error, ')}")
                continue
            lines.append(f"  {key}: {what}{origin}")
        from_overrides = all("from the override" in line for line in lines)
        where = "command-line overrides" if from_overrides else source
        raise ConfigError(f"{where}: invalid configuration\n" + "\n".join(lines)) from None


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping, got {type(data).__name__}")
    return data


PRESETS = Path(__file__).resolve().parents[2] / "presets"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def parse_run_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a YAML file or preset name (see `presets/`) plus `a.b=value`
    overrides: schema and sizes checked, nothing started, no heavy import."""
    data: dict = {}
    source = "<defaults>"
    name = "run"
    if path is not None:
        p = Path(path)
        if not p.exists() and (PRESETS / f"{path}.yaml").exists():
            p = PRESETS / f"{path}.yaml"
        elif not p.exists():
            raise ConfigError(f"config {str(path)!r} is neither a file nor a preset; presets: {preset_names()}")
        data, source, name = read_yaml(p), str(p), p.stem
    data.setdefault("name", name)
    overrides = list(overrides or [])
    cfg = load_model(RunConfig, apply_overrides(data, overrides, RunConfig), source, overrides)
    cfg.check_sizes()
    return resolve_paths(cfg)


ENGINE_KEYS = ("actor.micro_token_budget", "critic.micro_token_budget")
"""Run-config keys a reopened session may change (`Session.reopen(overrides=...)`): what the
engines are built with, which leaves the DAG as it is. Others may change the DAG (the stages a
loss needs, the data): a new session takes them."""


def engine_overrides(cfg: RunConfig | None, overrides: list[str]) -> RunConfig:
    """`cfg` with `a.b=value` overrides of ENGINE_KEYS, checked as a whole."""
    if cfg is None:
        raise ConfigError("reopen(overrides=...) changes the run config the engines are built with; this session "
                          "has none (it runs a DAG without a RunConfig)")
    keys = {canonical_key(k, flat_sections(RunConfig)): k for k in parse_overrides(overrides)}
    bad = [k for k in keys if k not in ENGINE_KEYS]
    if bad:
        raise ConfigError(f"reopen(overrides=...): {keys[bad[0]]!r} may change the DAG; a reopened session may change "
                          f"only {list(ENGINE_KEYS)} (open a new session for the rest: lab.rl_session(cfg, overrides))")
    new = load_model(RunConfig, apply_overrides(cfg.model_dump(exclude_unset=True), overrides, RunConfig), "reopen",
                     overrides)
    new.check_sizes()
    return new


def cache_root() -> Path:
    """Where built models, SFT warm starts and generated data are cached: $DISTFLOW_HOME,
    else ~/.cache/distflow_lab. One stable place, whatever the working directory."""
    import os

    home = os.environ.get("DISTFLOW_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "distflow_lab"


def resolve_paths(cfg: RunConfig) -> RunConfig:
    """Relative `model.path` and `data.cache_dir` resolve under `cache_root()`."""
    root = cache_root()
    fix = lambda p: p if Path(p).is_absolute() else str(root / p)  # noqa: E731
    return cfg.model_copy(update={
        "model": cfg.model.model_copy(update={"path": fix(cfg.model.path)}),
        "data": cfg.data.model_copy(update={"cache_dir": fix(cfg.data.cache_dir)}),
    })
