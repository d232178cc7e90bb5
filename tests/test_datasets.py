"""verl parquet schema, GSM8K conversion, synthetic arithmetic task."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pyarrow as pa
import pytest

from distflow_lab.datasets.gsm8k import convert_gsm8k, default_gsm8k_dir
from distflow_lab.datasets.schema import REQUIRED_COLUMNS, DatasetError, read_rows, validate_table, write_parquet
from distflow_lab.datasets.rewards import exact_match_reward
from distflow_lab.datasets.arithmetic import evaluate, make_arithmetic_rows, write_arithmetic_parquet
from distflow_lab.core.errors import ConfigError

GSM8K = default_gsm8k_dir()
# CI must read the real data: only a developer's machine without it may skip
needs_gsm8k = pytest.mark.skipif(not (GSM8K / "train.jsonl").exists() and not os.environ.get("CI"),
                                 reason=f"no GSM8K at {GSM8K}")


def _row(**over):
    row = {
        "data_source": "distflow/arithmetic",
        "prompt": [{"role": "user", "content": "1+1="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"split": "train", "index": 0},
    }
    row.update(over)
    return row


def test_missing_column_names_file_and_column():
    table = pa.Table.from_pylist([{k: v for k, v in _row().items() if k != "reward_model"}])
    with pytest.raises(DatasetError, match=r"data/x\.parquet.*missing.*reward_model"):
        validate_table(table, "data/x.parquet")
    assert set(REQUIRED_COLUMNS) == set(_row())


def test_row_level_defects_name_row(tmp_path):
    path = tmp_path / "bad.parquet"
    with pytest.raises(DatasetError, match=r"bad\.parquet.*row 1.*prompt"):
        write_parquet([_row(), _row(prompt=[])], path)
    rows = [_row(), _row(), _row(reward_model={"style": "rule", "ground_truth": None})]
    with pytest.raises(DatasetError, match=r"bad\.parquet.*row 2.*ground_truth"):
        write_parquet(rows, path)
    assert not path.exists()


def test_write_read_round_trip(tmp_path):
    rows = [_row(extra_info={"split": "train", "index": i}) for i in range(5)]
    path = write_parquet(rows, tmp_path / "sub" / "ok.parquet", row_group_size=2)
    assert read_rows(path) == rows


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(DatasetError, match=r"nothere\.parquet.*does not exist"):
        read_rows(tmp_path / "nothere.parquet")
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(b"PAR1 this is not really parquet")
    with pytest.raises(DatasetError, match=r"corrupt\.parquet.*parquet"):
        read_rows(bad)


@needs_gsm8k
def test_convert_real_gsm8k(tmp_path):
    n = convert_gsm8k(GSM8K / "train.jsonl", tmp_path / "train.parquet")
    assert n == 7473
    rows = read_rows(tmp_path / "train.parquet")
    assert len(rows) == 7473
    first = rows[0]
    assert first["data_source"] == "openai/gsm8k" and first["ability"] == "math"
    assert first["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert first["prompt"][0]["role"] == "user"
    assert first["prompt"][0]["content"].startswith("Natalia sold clips")
    assert first["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert first["extra_info"]["split"] == "train" and first["extra_info"]["index"] == 0
    assert first["extra_info"]["answer"].endswith("#### 72")
    assert all("," not in r["reward_model"]["ground_truth"] for r in rows)
    assert convert_gsm8k(GSM8K / "test.jsonl", tmp_path / "test.parquet", limit=10) == 10
    assert read_rows(tmp_path / "test.parquet")[0]["extra_info"]["split"] == "test"


def test_gsm8k_commas_and_malformed_lines(tmp_path):
    good = {"question": "Q?", "answer": "work\n#### 1,234"}
    src = tmp_path / "mini.jsonl"
    src.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    assert convert_gsm8k(src, tmp_path / "mini.parquet", split="train") == 2
    assert read_rows(tmp_path / "mini.parquet")[1]["reward_model"]["ground_truth"] == "1234"
    cases = {
        "{not json": r"bad\.jsonl:2: invalid JSON",
        json.dumps({"question": "Q?"}): r"bad\.jsonl:2: missing.*answer",
        json.dumps({"question": "Q?", "answer": "no final"}): r"bad\.jsonl:2:.*####",
    }
    for line, pattern in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(json.dumps(good) + "\n" + line + "\n")
        with pytest.raises(DatasetError, match=pattern):
            convert_gsm8k(bad, tmp_path / "bad.parquet")


def test_default_gsm8k_dir_env(monkeypatch, tmp_path):
    assert default_gsm8k_dir().parts[-3:] == ("shared", "datasets", "gsm8k")
    monkeypatch.setenv("DISTFLOW_GSM8K_DIR", str(tmp_path))
    assert default_gsm8k_dir() == tmp_path.resolve()


def test_arithmetic_deterministic_and_correct(tmp_path):
    a = make_arithmetic_rows(50, seed=3)
    assert a == make_arithmetic_rows(50, seed=3)
    assert a != make_arithmetic_rows(50, seed=4)
    for r in a:
        expr = r["prompt"][0]["content"]
        assert expr.endswith("=") and len(expr) == 4  # "d+d="
        x, y = expr[:-1].split("+")
        assert r["reward_model"]["ground_truth"] == str(int(x) + int(y))
        assert exact_match_reward(r["reward_model"]["ground_truth"] + "<eos>", r["reward_model"]["ground_truth"]) == 1.0
    hard = make_arithmetic_rows(200, seed=0, max_operand=99, ops=("+", "-", "*"), num_terms=3, allow_negative=False)
    for r in hard:
        expr = r["prompt"][0]["content"][:-1]
        assert int(r["reward_model"]["ground_truth"]) == eval(expr) >= 0  # test-only eval of our own digits/ops
    assert evaluate([2, 3, 4], ["+", "*"]) == 14 and evaluate([9, 2, 3], ["-", "-"]) == 4
    path = write_arithmetic_parquet(tmp_path / "arith.parquet", 20, seed=1, max_operand=5)
    assert read_rows(path) == make_arithmetic_rows(20, seed=1, max_operand=5)
    with pytest.raises(ValueError, match="ops"):
        make_arithmetic_rows(1, seed=0, ops=("/",))


def test_long_tail_task_rows_lengths_and_reward(tmp_path):
    """The long-tail task: "L<N>=" -> N digits, N lognormal; the built-in reward scores the length."""
    import numpy as np

    from distflow_lab.api.runner import load_run_config, prepare_data
    from distflow_lab.datasets.long_tail import answer, make_long_tail_rows, target_lengths
    from distflow_lab.datasets.rewards import REWARD_FNS

    rows = make_long_tail_rows(4096, seed=0, median=6, sigma=1.4, max_len=95)
    assert rows == make_long_tail_rows(4096, seed=0, median=6, sigma=1.4, max_len=95)
    n = np.array([int(r["extra_info"]["answer"]) for r in rows])
    assert all(r["prompt"][0]["content"] == f"L{k}=" and r["reward_model"]["ground_truth"] == answer(k)
               for r, k in zip(rows, n))
    assert np.median(n) == 6 and n.min() >= 1 and n.max() == 95
    per_batch = [b.max() / np.median(b) for b in n.reshape(-1, 32)]  # a step's 32 prompts
    assert np.median(per_batch) >= 10, np.median(per_batch)
    with pytest.raises(ValueError, match="median > 0"):
        target_lengths(4, 0, median=0, sigma=1, max_len=9)
    score = REWARD_FNS["distflow/long_tail"]
    assert score("0123456789<eos>junk", answer(10)) == 1.0 and score("01234", answer(10)) == 0.5
    assert score("0124", answer(4)) == 0.0 and score("", answer(3)) == 0.0
    assert score(answer(30), answer(10)) == 0.0  # three times too long: clipped at 0
    cfg = load_run_config("tiny-cpu-longtail", [f"data.cache_dir={tmp_path}", "data.options.long_tail.rows=64"])
    table = read_rows(prepare_data(cfg))
    assert len(table) == 64 and max(len(r["reward_model"]["ground_truth"]) for r in table) <= cfg.rollout.max_response_len - 1
    # the keys of the data section before the registry still read (saved configs), in the dataset they belong to
    old = load_run_config("tiny-cpu-longtail", [f"data.cache_dir={tmp_path}", "data.long_tail.rows=64"])
    assert old.data.options == cfg.data.options and prepare_data(old) == prepare_data(cfg)
    with pytest.raises(ConfigError, match=r"data.options.long_tail: dataset 'long_tail': option 'max_len': unknown"):
        load_run_config("tiny-cpu-longtail", ["data.options.long_tail.max_len=9"])
    with pytest.raises(ConfigError, match=r"data.options.longtail: 'longtail' is not a registered dataset"):
        load_run_config("tiny-cpu-longtail", ["data.options.longtail.rows=9"])
