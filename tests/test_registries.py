"""The extension points have one shape (core/registry.py): a decorated definition, typed options whose
unknown keys are named errors, user entries that reach the workers by value, and no name of a built-in
compared as a string outside its own registration. No Ray here: the Ray runs of notebook 02's CISPO and
OPO on every plane, schedule and engine are in tests/test_algo_matrix.py."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import cloudpickle
import pytest
from pydantic import Field

import distflow_lab as lab
from distflow_lab.algos.estimators import ESTIMATORS
from distflow_lab.algos.policy_losses import POLICY_LOSSES
from distflow_lab.algos.registry import ALGORITHMS, algorithm_names, load_run_config
from distflow_lab.core.config import ConfigError
from distflow_lab.core.registry import _REGISTRIES, user_entries
from distflow_lab.datasets.registry import DATASETS, dataset_names
from distflow_lab.datasets.schema import read_rows

from .notebook_cells import notebook_cells

PACKAGE = Path(lab.__file__).parent


@pytest.fixture(autouse=True)
def entries_leave_with_their_test():
    """What a test registers is gone after it: later tests see the library's registries, and their
    sessions ship no strays to the workers (the parity test counts every estimator)."""
    algorithm_names(), dataset_names()  # the built-ins, registered on first use, are in what is kept
    saved = {kind: dict(r._entries) for kind, r in _REGISTRIES.items()}
    yield
    for kind, entries in saved.items():
        _REGISTRIES[kind]._entries = entries


class Noise(lab.Options):
    scale: float = Field(default=1.0, gt=0)


def test_each_registry_names_the_entry_and_the_key_of_a_bad_option():
    notebook_cells("02_build_your_own.ipynb", "cispo-loss", "opo-estimator", OVERRIDES=[])
    cases = [(["algorithm.options.max_round=2", "algorithm.name=dapo"], r"algorithm.options: algorithm 'dapo': option 'max_round': unknown key"),
             (["algorithm.estimator_options.scale=2"], r"algorithm.estimator_options: estimator 'grpo': option 'scale'"),
             (["actor.policy_loss=cispo", "actor.policy_loss_options.eps=1"], r"actor.policy_loss_options: policy loss 'cispo': option 'eps'"),
             (["data.options.arithmetic.max_operands=3"], r"data.options.arithmetic: dataset 'arithmetic': option 'max_operands': unknown key"),
             (["algorithm.name=cispo2"], r"algorithm.name: 'cispo2' is not a registered algorithm; registered: \[.*'cispo'"),
             (["algorithm.adv_estimator=op"], r"algorithm.adv_estimator: 'op' is not a registered estimator"),
             (["algorithm.name=ppo", "algorithm.adv_estimator=opo"], r"ppo does not support 'opo' \(its kind is outcome"),
             (["data.train=tiny"], r"data.train: 'tiny' is neither a registered dataset")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_run_config("tiny-cpu-grpo", overrides)


def test_a_registration_is_one_decorated_definition_with_typed_options(tmp_path):
    @lab.register_estimator("noisy_grpo", options=Noise)
    def noisy(x):
        return ESTIMATORS.get("grpo").obj(x)

    @lab.register_dataset("count_to", options=Noise)
    def count_to(x):
        return [{"data_source": "distflow/arithmetic", "prompt": [{"role": "user", "content": f"{i}+0="}],
                 "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(i)},
                 "extra_info": {"split": x.split, "index": i}} for i in range(int(40 * x.options.scale))]

    cfg = load_run_config("tiny-cpu-grpo", ["algorithm.adv_estimator=noisy_grpo", "algorithm.estimator_options.scale=2",
                                            "data.train=count_to", "data.options.count_to.scale=1.5",
                                            f"data.cache_dir={tmp_path}"])
    assert ESTIMATORS.options("noisy_grpo", cfg.algorithm.estimator_options) == Noise(scale=2.0)
    from distflow_lab.api.runner import prepare_data

    rows = read_rows(prepare_data(cfg))
    assert len(rows) == 60 and rows[3]["reward_model"]["ground_truth"] == "3"
    with pytest.raises(ConfigError, match=r"option 'scale': Input should be greater than 0"):
        load_run_config("tiny-cpu-grpo", ["algorithm.adv_estimator=noisy_grpo", "algorithm.estimator_options.scale=0"])
    # the same cell run again replaces its entry; another definition under a taken name is refused
    lab.register_estimator("noisy_grpo", options=Noise)(noisy)
    with pytest.raises(ConfigError, match=r"estimator 'grpo' is registered twice"):
        lab.register_estimator("grpo")(noisy)
    with pytest.raises(ConfigError, match=r"options Dict must forbid unknown keys"):
        lab.register_policy_loss("loose", options=type("Dict", (lab.Options.__base__,), {}))(noisy)


def test_user_entries_reach_a_fresh_process_by_value():
    """What a worker does at set-up: install the driver's user entries, pickled as Ray pickles them,
    into a process that never ran the notebook; the names then resolve there, built-ins intact.
    Checking a config there (a multi-turn preset) loads no engine: transformers, vLLM and peft load
    where a stage runs, so a config error comes without their seconds of imports."""
    nb = notebook_cells("02_build_your_own.ipynb", "cispo-loss", "opo-estimator", OVERRIDES=[])
    sent = user_entries()
    assert {k: set(v) >= {"cispo"} if k != "estimator" else "opo" in v for k, v in sent.items()} and \
        not any(e.builtin for v in sent.values() for e in v.values())
    code = ("import sys, cloudpickle, torch\n"
            "from distflow_lab.core.registry import install\n"
            "install(cloudpickle.loads(sys.stdin.buffer.read()))\n"
            "from distflow_lab.algos.registry import algorithm\n"
            "from distflow_lab.algos.estimators import ESTIMATORS\n"
            "from distflow_lab.algos.policy_losses import POLICY_LOSSES\n"
            "from distflow_lab.algos.registry import load_run_config\n"
            "d = algorithm('cispo')\n"
            "load_run_config('tiny-cpu-calculator')  # GRPO: imports every built-in algorithm's module\n"
            "engines = sorted(m for m in ('transformers', 'vllm', 'peft') if m in sys.modules)\n"
            "print(d.policy_loss, d.estimator, POLICY_LOSSES.get('cispo').origin, engines, sorted(ESTIMATORS))\n")
    out = subprocess.run([sys.executable, "-c", code], input=cloudpickle.dumps(sent), capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    loss, default, origin, engines, estimators = out.stdout.decode().split(" ", 4)
    assert (loss, default, origin) == ("cispo", "grpo", "notebook_02_build_your_own")
    assert engines == "[]", f"checking a config loaded the engines {engines}: the CLI's errors wait seconds for them"
    assert {"opo", "grpo", "gae"} <= set(eval(estimators))
    assert nb.cispo_cfg.actor.policy_loss == "cispo"


def test_no_builtin_name_is_compared_as_a_string_outside_its_registration():
    """`grep` for `== "grpo"`, `!= 'gae'`, `in ("arithmetic", ...)` over the package finds nothing: a
    choice by name goes through the declaration (an algorithm's facts, an estimator's kind)."""
    names = {*algorithm_names(), *ESTIMATORS, *POLICY_LOSSES, *dataset_names()}
    names = {n for n in names if n in ALGORITHMS and ALGORITHMS.get(n).builtin or n in ESTIMATORS and
             ESTIMATORS.get(n).builtin or n in POLICY_LOSSES and POLICY_LOSSES.get(n).builtin or
             n in DATASETS and DATASETS.get(n).builtin}
    alt = "|".join(sorted(map(re.escape, names)))
    compared = re.compile(rf"""(==|!=)\s*["']({alt})["']|["']({alt})["']\s*(==|!=)|\bin\s*\(["']({alt})["']""")
    found = [f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if compared.search(line)]
    assert found == [], found


PLUGIN = '''
import distflow_lab as lab
from pydantic import Field


class Scale(lab.Options):
    scale: float = Field(default=1.0, gt=0)


@lab.register_estimator("scaled_grpo", options=Scale)
def scaled(x):
    raise NotImplementedError


@lab.register_dataset("count_to")
def count_to(x):
    return [{"data_source": "distflow/arithmetic", "prompt": [{"role": "user", "content": f"{i}+0="}],
             "ability": "arithmetic", "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"split": x.split, "index": i}} for i in range(7)]


def plain(x):
    raise NotImplementedError
'''


def test_a_config_names_an_entry_by_import_path(tmp_path, monkeypatch):
    """Scripts and the CLI, where no notebook cell ran: "module:name" imports the module (its decorators
    register) and names the entry whose object that is; an undecorated or missing one is a named error."""
    (tmp_path / "distflow_plugin_probe.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_run_config("tiny-cpu-grpo", ["algorithm.adv_estimator=distflow_plugin_probe:scaled",
                                            "algorithm.estimator_options.scale=2",
                                            "data.train=distflow_plugin_probe:count_to"])
    path = cfg.algorithm.adv_estimator
    assert ESTIMATORS.get(path).obj is ESTIMATORS.get("scaled_grpo").obj
    assert ESTIMATORS.options(path, cfg.algorithm.estimator_options).scale == 2.0
    for override, message in [("actor.policy_loss=distflow_plugin_probe:plain",
                               r"actor.policy_loss: 'distflow_plugin_probe:plain' is not a registered policy loss: "
                               "decorate it with lab.register_policy_loss"),
                              ("algorithm.adv_estimator=distflow_plugin_nope:x",
                               r"algorithm.adv_estimator: cannot import module 'distflow_plugin_nope'")]:
        with pytest.raises(ConfigError, match=message):
            load_run_config("tiny-cpu-grpo", [override])
    cli = Path(sys.executable).parent / "distflow-lab"  # the console script: the current folder is not on its path
    out = subprocess.run([str(cli), "data", "distflow_plugin_probe:count_to", "--out", "d"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "train.parquet: 7 rows" in out.stdout, out.stderr[-2000:]
