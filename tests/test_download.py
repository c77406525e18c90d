import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minisparse import download
from minisparse.config.schema import DataConfig
from minisparse.data.datasets import load_prompts
from minisparse.models.tiny import build_tokenizer
from scripts.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
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


def test_only_rows_a_run_can_train_on_are_written(tmp_path, capsys):
    """The paper's file as published holds rows with an empty label; they are dropped,
    and counted by reason, as repeated rows are."""
    import pandas as pd

    bad = [{"question": "Which of these is prime?", "gt_answer": "", "level": 5},
           {"question": "How many?", "gt_answer": None, "level": 4},
           {"question": "  ", "gt_answer": "3", "level": 3}]
    subset = tmp_path / "src" / "simplelr_test"
    subset.mkdir(parents=True)
    pd.DataFrame([ROWS[0], *bad, *ROWS[1:]]).to_parquet(subset / "train.parquet")
    out = tmp_path / "out"
    assert download.main(["--dataset", "simplelr_test", "--out", str(out),
                          "--source", str(tmp_path / "src")]) == 0
    rows = read_jsonl(out / "simplelr_test.jsonl")
    assert rows == [{"prompt": r["question"], "label": r["gt_answer"]} for r in ROWS]
    assert capsys.readouterr().out == (
        f"wrote 3 rows to {out / 'simplelr_test.jsonl'} (2 rows without a label dropped; "
        f"1 row with an empty prompt dropped)\n")


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


# ---------------------------------------------------------------- named sets (DAPO, AIME)
from minisparse.data.sources import DAPO_HEAD, DAPO_TAIL, SOURCES, HubFile  # noqa: E402

PROBLEMS = [("What is $3 + 4$?", "7"), ("Find $x$ if $2x = 10$.", "5"),
            ("How many primes are below $10$?", "4")]
BOXED = "Please reason step by step, and put your final answer within \\boxed{}."
EXPECTED = [{"prompt": f"{q} {BOXED}", "label": a} for q, a in PROBLEMS]


def dapo_text(problem: str) -> str:
    return DAPO_HEAD + problem + DAPO_TAIL


def original_rows(repeat: int) -> list[dict]:
    """BytedTsinghua-SIA's parquet layout: the prompt as chat messages, the answer in
    reward_model, every problem repeated (`repeat` copies, the file's order)."""
    return [{"data_source": "math_dapo",
             "prompt": [{"content": dapo_text(q), "role": "user"}],
             "ability": "MATH",
             "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
             "extra_info": {"index": f"id-{i}-{k}"}}
            for i, (q, a) in enumerate(PROBLEMS) for k in range(repeat)]


def slime_rows(as_messages: bool) -> list[dict]:
    """slime's JSONL layout (zhuzilin/...): `prompt` (text, or chat messages) and `label`."""
    return [{"prompt": [{"role": "user", "content": dapo_text(q)}] if as_messages
             else dapo_text(q), "label": a} for q, a in PROBLEMS]


def test_registry_names_the_hub_files():
    """Where each named set is read from by default, and the original it also reads."""
    assert SOURCES["dapo_math_17k"].files == (
        HubFile("zhuzilin/dapo-math-17k", "dapo-math-17k.jsonl"),
        HubFile("BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet"))
    assert SOURCES["aime_2024"].files == (
        HubFile("zhuzilin/aime-2024", "aime-2024.jsonl"),
        HubFile("BytedTsinghua-SIA/AIME-2024", "data/aime-2024.parquet"))
    assert SOURCES["simplelr_qwen_level3to5"].files == (
        HubFile("hkust-nlp/SimpleRL-Zoo-Data", "simplelr_qwen_level3to5/{split}.parquet"),)


@pytest.mark.parametrize("argv,repo,file", [
    (["--dataset", "dapo_math_17k"], "zhuzilin/dapo-math-17k", "dapo-math-17k.jsonl"),
    (["--dataset", "dapo_math_17k", "--source", "BytedTsinghua-SIA/DAPO-Math-17k"],
     "BytedTsinghua-SIA/DAPO-Math-17k", "data/dapo-math-17k.parquet"),
    (["--dataset", "aime_2024"], "zhuzilin/aime-2024", "aime-2024.jsonl"),
    (["--dataset", "simplelr_qwen_level3to5"], "hkust-nlp/SimpleRL-Zoo-Data",
     "simplelr_qwen_level3to5/train.parquet"),
    (["--dataset", "simplelr_abel_level3to5", "--split", "test"],
     "hkust-nlp/SimpleRL-Zoo-Data", "simplelr_abel_level3to5/test.parquet"),
    (["--dataset", "mine", "--source", "me/my-math"], "me/my-math", "mine/train.parquet"),
])
def test_what_the_hub_is_asked_for(tmp_path, monkeypatch, argv, repo, file):
    """No network: the request each command makes of the hub, answered with rows in the
    layout of the file it asks for."""
    import datasets

    asked = []
    rows = original_rows(1) if file.endswith(".parquet") and "DAPO" in repo else \
        slime_rows(False) if "zhuzilin" in repo else ROWS

    def fake_load(path, data_files=None, split=None):
        asked.append((path, data_files, split))
        return datasets.Dataset.from_list(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    monkeypatch.setattr(download, "hub_unreachable", lambda: None)  # as if online
    assert download.main([*argv, "--out", str(tmp_path)]) == 0
    assert asked == [(repo, file, "train")]


def test_no_hub_names_the_way_round(tmp_path, monkeypatch, capsys):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'zhuzilin/aime-2024' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(download, "hub_unreachable", lambda: None)  # reached, then failed
    assert download.main(["--dataset", "aime_2024", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        "download error: Couldn't reach 'zhuzilin/aime-2024' on the Hub. Where the hub is "
        "out of reach, fetch the file elsewhere (hf download --repo-type dataset "
        "zhuzilin/aime-2024 --local-dir DIR) and pass --source DIR\n")
    assert not (tmp_path / "aime_2024.jsonl").exists()


ELSEWHERE = ("fetch the file elsewhere (hf download --repo-type dataset zhuzilin/aime-2024 "
             "--local-dir DIR) and pass --source DIR\n")


def test_an_unreachable_hub_is_one_line_at_once(tmp_path, monkeypatch, capsys):
    """Offline, the hub client retried five times (28 s of 'Retrying in 8s' lines) before
    the line that says what to do."""
    import datasets

    def never(*args, **kwargs):
        raise AssertionError("the hub client was asked")

    monkeypatch.setattr(datasets, "load_dataset", never)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE",
                 "HF_DATASETS_OFFLINE"):  # (the latter set by this file's fixture)
        monkeypatch.delenv(name, raising=False)
    port = free_ports()  # nothing listens there
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    assert download.main(["--dataset", "aime_2024", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"download error: the Hugging Face hub is out of reach "
                                       f"(127.0.0.1:{port}: Connection refused): {ELSEWHERE}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert download.main(["--dataset", "aime_2024", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == ("download error: the Hugging Face hub is out of reach "
                                       f"(HF_HUB_OFFLINE is set): {ELSEWHERE}")
    assert not (tmp_path / "aime_2024.jsonl").exists()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # the client finds out
    assert download.hub_unreachable() is None


def test_ctrl_c_is_one_line_and_the_command_that_goes_on(tmp_path):
    """Ctrl-C while the hub is asked (a server that never answers) printed a 35-69-line
    KeyboardInterrupt traceback."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.settimeout(120)
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.getsockname()[1]}",
               "HF_HOME": str(tmp_path / "hf")}
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # (this file's fixture)
            env.pop(name, None)
        argv = ["--dataset", "aime_2024", "--out", str(tmp_path)]
        proc = subprocess.Popen([sys.executable, "-m", "minisparse.download", *argv],
                                cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        held = [server.accept()[0] for _ in range(2)]  # the reach check, then the request
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
        for conn in held:
            conn.close()
    assert proc.returncode == 130
    assert stderr == ("download: stopped by Ctrl-C; nothing written; the same command goes "
                      f"on: python -m minisparse.download {' '.join(argv)}\n")
    assert stdout == "" and not (tmp_path / "aime_2024.jsonl").exists()


@pytest.mark.parametrize("name", ["dapo_math_17k", "aime_2024"])
def test_original_parquet_to_boxed_prompts(tmp_path, capsys, name):
    """The DAPO authors' file: messages to text, DAPO's "Answer:" instruction replaced by
    the boxed one the grader reads, repeats dropped, in first-seen order."""
    import pandas as pd

    src = tmp_path / "hf" / SOURCES[name].files[1].path  # where hf download puts it
    src.parent.mkdir(parents=True)
    pd.DataFrame(original_rows(3)).to_parquet(src)
    out = tmp_path / "out"
    assert download.main(["--dataset", name, "--out", str(out),
                          "--source", str(tmp_path / "hf")]) == 0
    assert read_jsonl(out / f"{name}.jsonl") == EXPECTED
    assert capsys.readouterr().out == (
        f"wrote 3 rows to {out / name}.jsonl (6 repeated rows dropped; prompts end in "
        f"the \\boxed{{}} instruction)\n")


@pytest.mark.parametrize("as_messages", [False, True])
def test_slime_jsonl_gives_the_same_rows(tmp_path, as_messages):
    """slime's file (text or chat-message prompts), as `hf download --local-dir` leaves
    it, gives the same JSONL; the math grader scores a boxed answer against the label."""
    from minisparse.data.reward import math_reward

    folder = tmp_path / "dapo-math-17k"
    folder.mkdir()
    (folder / "dapo-math-17k.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in slime_rows(as_messages)))
    assert download.main(["--dataset", "dapo_math_17k", "--out", str(tmp_path),
                          "--source", str(folder)]) == 0
    rows = read_jsonl(tmp_path / "dapo_math_17k.jsonl")
    assert rows == EXPECTED
    assert math_reward("so $x = 5$, \\boxed{5}", rows[1]["label"]) == 1.0
    assert math_reward("Answer: 5", rows[1]["label"]) == 0.0  # why the prompt is rewritten


def test_text_without_dapo_instruction_is_kept_whole(tmp_path):
    src = tmp_path / "aime.jsonl"
    src.write_text(json.dumps({"prompt": "Compute $1 + 1$.", "label": 2}) + "\n")
    assert download.main(["--dataset", "aime_2024", "--out", str(tmp_path),
                          "--source", str(src)]) == 0
    assert read_jsonl(tmp_path / "aime_2024.jsonl") == [
        {"prompt": f"Compute $1 + 1$. {BOXED}", "label": "2"}]


def test_unknown_name_lists_the_named_sets(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        download.main(["--dataset", "dapo_math", "--out", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown dataset 'dapo_math'; the named ones:" in err
    for name in ("dapo_math_17k", "aime_2024", "simplelr_qwen_level3to5", "simplelr_*"):
        assert f"\n  {name} " in err
    assert "--source FILE, FOLDER or HUB_ID" in err
    assert not list(tmp_path.iterdir())


def test_a_bad_row_names_itself_and_leaves_no_file(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    src.write_text(json.dumps({"prompt": [{"role": "system", "content": "x"}], "label": "1"})
                   + "\n")
    out = tmp_path / "out"
    assert download.main(["--dataset", "dapo_math_17k", "--out", str(out),
                          "--source", str(src)]) == 1
    assert "row 0: prompt holds no user message" in capsys.readouterr().err
    assert list(out.iterdir()) == []


def test_dapo_config_reads_what_the_download_writes(tmp_path, monkeypatch):
    """qwen3b_dapo's data.path, missing, names `--dataset dapo_math_17k --out data/`; what
    that writes loads with the config's data settings (chat template on plain text)."""
    from minisparse.config.load import load_config
    from minisparse.data.datasets import DataError, require_data_file

    cfg = load_config("qwen3b_dapo")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as info:
        require_data_file(cfg.data.path)
    argv = str(info.value).split("fetch it with: ")[1].split()[3:]
    assert argv == ["--dataset", "dapo_math_17k", "--out", "data/"]
    (tmp_path / "slime.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in slime_rows(False)))
    assert download.main([*argv, "--source", "slime.jsonl"]) == 0
    tokenizer = build_tokenizer()
    rows = load_prompts(cfg.data, tokenizer)
    assert [r.label for r in rows] == ["7", "5", "4"]
    assert rows[0].prompt_text == tokenizer.apply_chat_template(
        [{"role": "user", "content": EXPECTED[0]["prompt"]}], tokenize=False,
        add_generation_prompt=True)
