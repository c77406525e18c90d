import json

import pytest

from minisparse import download
from minisparse.config.schema import DataConfig
from minisparse.data.datasets import load_prompts
from minisparse.models.tiny import build_tokenizer

ROWS = [
    {"question": "What is $3 + 4$?", "gt_answer": "7", "level": 3},
    {"question": "Simplify $\\frac{2}{4}$.", "gt_answer": "\\frac{1}{2}", "level": 4},
    {"question": "How many primes are below 10?", "gt_answer": "4", "level": 3},
]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_parquet_dir_layout_to_jsonl(tmp_path, capsys):
    import pandas as pd

    subset = tmp_path / "src" / "simplelr_test"
    subset.mkdir(parents=True)
    pd.DataFrame(ROWS).to_parquet(subset / "train.parquet")
    out = tmp_path / "out"
    assert download.main(["--dataset", "simplelr_test", "--out", str(out),
                          "--source", str(tmp_path / "src")]) == 0
    rows = read_jsonl(out / "simplelr_test.jsonl")
    assert rows == [{"prompt": r["question"], "label": str(r["gt_answer"])} for r in ROWS]
    assert "wrote 3 rows" in capsys.readouterr().out
    loaded = load_prompts(DataConfig(path=str(out / "simplelr_test.jsonl")), build_tokenizer())
    assert [r.label for r in loaded] == ["7", "\\frac{1}{2}", "4"]


@pytest.mark.parametrize("config", ["qwen3b_rkv", "llama1b_rkv"])
def test_paper_config_reads_what_the_download_command_writes(tmp_path, monkeypatch, config):
    """`--dataset NAME --out data/` (run in the checkout) writes the config's data.path,
    and that path, missing, names this very command."""
    import pandas as pd

    from minisparse.config.load import load_config
    from minisparse.data.datasets import DataError, require_data_file

    path = load_config(config).data.path
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        require_data_file(path)
    command = str(info.value).split("fetch it with: ")[1]
    argv = command.split()[3:]  # after "python -m minisparse.download"
    subset = tmp_path / "src" / argv[argv.index("--dataset") + 1]
    subset.mkdir(parents=True)
    pd.DataFrame(ROWS).to_parquet(subset / "train.parquet")
    assert download.main([*argv, "--source", str(tmp_path / "src")]) == 0
    require_data_file(path)
    assert len(read_jsonl(tmp_path / path)) == len(ROWS)


def test_json_file_with_chat_prompts_and_explicit_fields(tmp_path):
    src = tmp_path / "train.jsonl"
    messages = [{"role": "user", "content": "What is 6 * 7?"}]
    src.write_text(json.dumps({"msgs": messages, "meta": {"answer": ["42"]}}) + "\n")
    assert download.main(["--dataset", "chat", "--out", str(tmp_path), "--source", str(src),
                          "--prompt-field", "msgs", "--label-field", "meta.answer"]) == 0
    assert read_jsonl(tmp_path / "chat.jsonl") == [{"prompt": messages, "label": "42"}]


def test_errors_are_reported(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"text": "x", "answer": "1"}) + "\n")
    assert download.main(["--dataset", "d", "--out", str(tmp_path), "--source", str(src)]) == 1
    assert "cannot find the prompt field among ['answer', 'text']" in capsys.readouterr().err
    empty = tmp_path / "emptydir"
    empty.mkdir()
    assert download.main(["--dataset", "d", "--out", str(tmp_path),
                          "--source", str(empty)]) == 1
    assert "no train.parquet" in capsys.readouterr().err
