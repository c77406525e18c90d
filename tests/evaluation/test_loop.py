"""The evaluation loop (evaluation/loop.py) with a scripted engine whose responses are known, so accuracy,
pass@k, the result files and resume can be checked exactly; and split over ranks as
train.py's in-training evaluation runs it."""
import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from spawned_ranks import spawned_rank

from minisparse.config.schema import RewardConfig
from minisparse.data.benchmarks import Problem
from minisparse.evaluation.loop import evaluate
from minisparse.evaluation.results import ResultsMismatchError
from minisparse.evaluation.scores import flat_metrics, format_table


@pytest.fixture(scope="module")
def tokenizer():
    from minisparse.models.tiny import build_tokenizer

    return build_tokenizer()


# ---------------------------------------------------------------- scripted engine


@dataclass
class Out:
    prompt_index: int
    sample_index: int
    token_ids: list
    finish_reason: str = "stop"


@dataclass
class ScriptedEngine:
    """Answers prompt i, sample j with script[i][j] (text), encoded by the tokenizer."""

    tokenizer: object
    script: list
    calls: list = field(default_factory=list)

    def generate(self, prompts, params, progress=False):
        self.calls.append((len(prompts), params.n, params.max_new_tokens))
        outs = []
        for i in range(len(prompts)):
            for j in range(params.n):
                ids = self.tokenizer.encode(self.script[i][j], add_special_tokens=False)
                finish = "length" if len(ids) > params.max_new_tokens else "stop"
                outs.append(Out(i, j, ids[: params.max_new_tokens], finish))
        return outs


def _eval_cfg(**kw):
    base = dict(benchmarks=["math500"], data_dir="unused", limit=None, max_new_tokens=None,
                temperature=0.8, top_p=0.95, n_samples=4, prompt_template="boxed")
    return SimpleNamespace(**{**base, **kw})


PROBLEMS = {"math500": [Problem("math500", 0, "1+1?", "2"), Problem("math500", 1, "2*3?", "6")]}
SCRIPT = [
    ["so \\boxed{2}", "\\boxed{3}", "no answer", "\\boxed{5}"],
    ["\\boxed{6}", "\\boxed{6}", "\\boxed{7}", "it is \\boxed{1}"],
]


def test_evaluate_scripted_outputs_and_files(tokenizer, tmp_path):
    engine = ScriptedEngine(tokenizer, SCRIPT)
    summary = evaluate(engine, tokenizer, _eval_cfg(), tmp_path, problems=PROBLEMS,
                       settings={"model": "scripted"}, seed=3, progress=False, log=lambda s: None)
    assert engine.calls == [(2, 4, 8192)]  # math500's protocol token limit
    m = summary["benchmarks"]["math500"]
    assert m["accuracy"] == pytest.approx(3 / 8)
    assert m["pass_at_k"] == pytest.approx({"pass@1": 0.375, "pass@2": (0.5 + 5 / 6) / 2,
                                            "pass@4": 1.0})
    assert summary["average_accuracy"] == pytest.approx(3 / 8)
    lines = (tmp_path / "math500" / "samples.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["correct"] for r in rows] == [True, False, False, False, True, True, False, False]
    assert [r["extracted_answer"] for r in rows[:4]] == ["2", "3", "", "5"]
    assert rows[2]["response"] == "no answer"
    assert rows[5]["sample_index"] == 1 and rows[5]["ground_truth"] == "6"
    saved = json.loads((tmp_path / "math500" / "metrics.json").read_text())
    assert saved["settings"]["model"] == "scripted" and saved["settings"]["n_samples"] == 4
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["benchmarks"]["math500"]["accuracy"] == pytest.approx(3 / 8)
    assert flat_metrics(summary)["eval/math500/pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert "math500" in format_table(summary)


def test_evaluate_skips_finished_and_detects_mismatch(tokenizer, tmp_path):
    kw = dict(problems=PROBLEMS, settings={"model": "scripted"}, progress=False,
              log=lambda s: None)
    evaluate(ScriptedEngine(tokenizer, SCRIPT), tokenizer, _eval_cfg(), tmp_path, **kw)
    again = ScriptedEngine(tokenizer, SCRIPT)
    summary = evaluate(again, tokenizer, _eval_cfg(), tmp_path, **kw)
    assert again.calls == [] and summary["benchmarks"]["math500"]["accuracy"] == 0.375
    with pytest.raises(ResultsMismatchError, match="differ: n_samples"):
        evaluate(again, tokenizer, _eval_cfg(n_samples=2), tmp_path, **kw)
    evaluate(again, tokenizer, _eval_cfg(n_samples=2), tmp_path, overwrite=True, **kw)
    assert again.calls == [(2, 2, 8192)]
    assert len((tmp_path / "math500" / "samples.jsonl").read_text().splitlines()) == 4


def test_unfinished_benchmark_is_redone(tokenizer, tmp_path):
    kw = dict(problems=PROBLEMS, progress=False, log=lambda s: None)
    evaluate(ScriptedEngine(tokenizer, SCRIPT), tokenizer, _eval_cfg(), tmp_path, **kw)
    (tmp_path / "math500" / "metrics.json").unlink()  # as if killed before the last write
    engine = ScriptedEngine(tokenizer, SCRIPT)
    evaluate(engine, tokenizer, _eval_cfg(), tmp_path, **kw)
    assert engine.calls == [(2, 4, 8192)]
    assert not list((tmp_path / "math500").glob("*.tmp"))


def test_truncation_and_protocol_override(tokenizer):
    engine = ScriptedEngine(tokenizer, [["x" * 50] * 4, ["6"] * 4])
    summary = evaluate(engine, tokenizer, _eval_cfg(max_new_tokens=3, n_samples=4),
                       problems=PROBLEMS, progress=False, log=lambda s: None)
    m = summary["benchmarks"]["math500"]
    assert engine.calls == [(2, 4, 3)]
    assert m["truncated_fraction"] == 0.5 and m["max_new_tokens"] == 3
    assert m["mean_response_tokens"] <= 3


def test_reward_settings_reach_the_grader(tokenizer, grade_calls):
    summary = evaluate(ScriptedEngine(tokenizer, SCRIPT), tokenizer, _eval_cfg(),
                       problems=PROBLEMS, progress=False, log=lambda s: None,
                       reward=RewardConfig(workers=3, timeout_s=0.7))
    assert grade_calls == [(3, 0.7)]
    assert summary["benchmarks"]["math500"]["accuracy"] == pytest.approx(3 / 8)


# ---------------------------------------------------------------- split over ranks


def test_shard_bounds_cover_every_item_once():
    from minisparse.evaluation.generate import Shard

    assert [Shard(r, 2).bounds(5) for r in range(2)] == [(0, 3), (3, 5)]
    assert [Shard(r, 3).bounds(1) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]
    assert [Shard(r, 4).bounds(8) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert Shard().bounds(7) == (0, 7)


def _eval_engine(tiny_path):
    import torch

    from minisparse.config.schema import EngineConfig
    from minisparse.engine import LLMEngine
    from minisparse.models.loading import load_policy

    model, tok = load_policy(str(tiny_path), "float32", "cpu")
    torch.manual_seed(0)
    args = EngineConfig(page_size=4, kv_cpu_memory_gb=0.05, max_num_seqs=32,
                        max_prefill_tokens=2048, cuda_graphs=False)
    return LLMEngine(model, tok, args, None, "cpu"), tok


SPLIT_CFG = dict(benchmarks=["gsm8k", "amc23"], n_samples=3, max_new_tokens=12)


def _split_problems():
    """5 gsm8k problems (split 3 + 2) and one amc23 problem (rank 1 gets none)."""
    gsm8k = [Problem("gsm8k", i, f"What is {i} + {i + 2}?", str(2 * i + 2)) for i in range(5)]
    return {"gsm8k": gsm8k, "amc23": [Problem("amc23", 0, "What is 6 * 7?", "42")]}


def _split_worker(rank, world, init_file, tiny_path, out_dir):
    import pickle

    from minisparse.evaluation.generate import Shard
    from minisparse.utils.distributed import all_gather_object

    with spawned_rank(rank, world, init_file):
        engine, tok = _eval_engine(tiny_path)
        summary = evaluate(engine, tok, _eval_cfg(**SPLIT_CFG), out_dir / "split", seed=11,
                           problems=_split_problems(), progress=False, log=lambda s: None,
                           shard=Shard(rank, world, all_gather_object))
        (out_dir / f"summary_rank{rank}.pkl").write_bytes(pickle.dumps(summary))


TIMING = ("generation_s", "tokens_per_s", "grading_s", "engine", "ranks")


def _scores(summary):
    return {name: {k: v for k, v in m.items() if k not in TIMING}
            for name, m in summary["benchmarks"].items()}


def test_two_gloo_ranks_score_like_one_process(tiny_path, tmp_path):
    """Each of 2 ranks generates its block of each benchmark; the gathered samples and
    scores equal one process's on the same seeds, on both ranks; rank 0 alone writes."""
    import pickle

    import torch.multiprocessing as mp

    mp.spawn(_split_worker, args=(2, str(tmp_path / "init"), tiny_path, tmp_path), nprocs=2)
    engine, tok = _eval_engine(tiny_path)
    whole = evaluate(engine, tok, _eval_cfg(**SPLIT_CFG), tmp_path / "whole", seed=11,
                     problems=_split_problems(), progress=False, log=lambda s: None)
    ranks = [pickle.loads((tmp_path / f"summary_rank{r}.pkl").read_bytes()) for r in (0, 1)]
    assert _scores(ranks[0]) == _scores(ranks[1]) == _scores(whole)
    assert ranks[0]["benchmarks"]["gsm8k"]["ranks"] == 2
    assert _scores(whole)["gsm8k"]["samples"] == 15
    assert _scores(whole)["gsm8k"]["mean_response_tokens"] > 0
    for name in ("gsm8k", "amc23"):
        split = (tmp_path / "split" / name / "samples.jsonl").read_text()
        assert split == (tmp_path / "whole" / name / "samples.jsonl").read_text()
    assert ranks[0]["average_accuracy"] == whole["average_accuracy"]


def test_training_file_scores_each_row_with_its_own_prompt(tokenizer, tmp_path):
    from minisparse.data.benchmarks import load_benchmarks

    templated = ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    messages = [{"role": "user", "content": "What is 3+3?"}]
    rows = [{"prompt": templated, "label": "4"},
            {"prompt": "What is 5+5?", "label": ""},  # no label: training leaves it out too
            {"prompt": messages, "label": 6}]
    path = tmp_path / "my_train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    problems = load_benchmarks([str(path)], "unused")
    assert list(problems) == ["my_train"]  # results are filed under the file's stem
    assert [(p.index, p.answer) for p in problems["my_train"]] == [(0, "4"), (1, "6")]

    class Recording(ScriptedEngine):
        def generate(self, prompts, params, progress=False):
            self.prompts = prompts
            return super().generate(prompts, params, progress)

    engine = Recording(tokenizer, [["\\boxed{4}"], ["\\boxed{7}"]])
    summary = evaluate(engine, tokenizer, _eval_cfg(n_samples=1), tmp_path / "out",
                       problems=problems, progress=False, log=lambda s: None)
    # the row's own text (no eval template around it), and messages through the chat template
    assert tokenizer.decode(engine.prompts[0]) == templated
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(engine.prompts[1]) == chat
    assert summary["benchmarks"]["my_train"]["accuracy"] == 0.5
    assert engine.calls == [(2, 1, 8192)]  # a training file's protocol: 8,192 tokens
    assert (tmp_path / "out" / "my_train" / "samples.jsonl").is_file()
