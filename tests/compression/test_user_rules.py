"""compress.algorithm names a shipped rule (a file of compression/rules/) or a rule in the
user's own module (module.path:ClassName), resolved by one function, rule_class. Every
shipped rule and docs/compression.md's my_rules.py (written outside the package) compress
in a one-rollout tiny train and a tiny eval; a rule that cannot be resolved stops
train.py, eval.py and the engine bench with one line before any model loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval as eval_cli
from minisparse.compression import RKV, RuleError, ScoringRule, build_rule, rule_class
from minisparse.config.schema import CompressConfig
from minisparse.config.schema import rule_names
from minisparse.bench import run as bench

from .helpers import doc_rule_module, make_inputs

REPO = Path(__file__).resolve().parents[2]
USER_RULE = "my_rules:MyRule"
# Not a ScoringRule: appended to the documented module for the error case.
NOT_A_RULE = "\n\nclass NotARule:\n    pass\n"
# Rules whose scores cannot be ranked: appended for the bad-output cases.
BAD_OUTPUTS = '''

class OneShort(MyRule):
    def score_batch(self, keys, queries, lengths):
        return super().score_batch(keys, queries, lengths)[..., :-1]


class Raises(MyRule):
    def score_batch(self, keys, queries, lengths):
        raise KeyError("missing")
'''
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def rules_dir(tmp_path_factory) -> Path:
    """A folder outside the package holding my_rules.py, the documented example."""
    folder = tmp_path_factory.mktemp("user-rules")
    (folder / "my_rules.py").write_text(doc_rule_module() + NOT_A_RULE + BAD_OUTPUTS)
    return folder


@pytest.fixture
def user_path(rules_dir, monkeypatch) -> Path:
    """rules_dir importable in this process (in-process eval and bench)."""
    monkeypatch.syspath_prepend(str(rules_dir))
    return rules_dir


def _train(rules_dir: Path, cache: Path, *sets: str) -> subprocess.CompletedProcess:
    """train.py on tiny_rkv, my_rules importable through PYTHONPATH as a user's would be."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env.update(MINISPARSE_CACHE=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(rules_dir),
                                                        env.get("PYTHONPATH")])))
    args = [arg for key in sets for arg in ("--set", key)]
    return subprocess.run([sys.executable, "train.py", "--config", "tiny_rkv", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _eval_args(out: Path, model: str, algorithm: str) -> list[str]:
    return ["--model", model, "--benchmarks", "arithmetic", "--limit", "2", "--compress",
            algorithm, "--budget", "32", "--divide-length", "8", "--dtype", "float32",
            "--device", "cpu", "--n-samples", "1", "--max-new-tokens", "16", "--no-progress",
            "--kv-cpu-memory-gb", "0.25", "--output", str(out)]


def test_rule_class_resolves_shipped_and_user_rules_alike(user_path):
    assert rule_class("rkv") is RKV is rule_class("minisparse.compression.rules.rkv:RKV")
    mine = rule_class(USER_RULE)
    assert issubclass(mine, ScoringRule) and mine.__module__ == "my_rules"
    assert mine.name == "LastQuery" and mine.uses_queries

    class Tweaked(RKV):  # a subclass names itself, not its parent
        pass

    assert (Tweaked.name, RKV.name, ScoringRule.name) == ("Tweaked", "R-KV", "ScoringRule")


@pytest.mark.parametrize("algorithm", [*rule_names(), USER_RULE])
def test_rule_compresses_in_a_tiny_train_and_eval(
        algorithm, rules_dir, user_path, tiny_path, tmp_path, _minisparse_cache):
    out = tmp_path / "train"
    res = _train(rules_dir, _minisparse_cache, f"compress.algorithm={algorithm}",
                 "num_rollout=1", "save_interval=0", "log.tensorboard=false",
                 f"output_dir={out}")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"rollout KV cache: {rule_class(algorithm).name}, 16 tokens kept" in res.stdout
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["compress/compressions_per_sample"] > 0
    assert row["compress/evicted_tokens_per_sample"] > 0

    evaluated = tmp_path / "eval"
    assert eval_cli.main(_eval_args(evaluated, "tiny", algorithm)) == 0
    summary = json.loads((evaluated / "arithmetic" / "metrics.json").read_text())
    assert summary["settings"]["compress"]["algorithm"] == algorithm
    assert summary["metrics"]["mean_compressions"] > 0
    assert summary["metrics"]["engine"]["evicted_tokens"] > 0


BAD_RULES = {
    "missing module": ("no_such_rules_xyz:MyRule",
                       "cannot import module no_such_rules_xyz: No module named "
                       "'no_such_rules_xyz' (is its folder on sys.path, e.g. PYTHONPATH?)"),
    "missing class": ("my_rules:Nope", "module my_rules has no class Nope"),
    "not a rule": ("my_rules:NotARule",
                   "NotARule in module my_rules is not a ScoringRule subclass"),
}


def _train_error(spec: str, model: Path, rules_dir: Path, cache: Path, out: Path,
                 capsys) -> tuple[int, str]:
    res = _train(rules_dir, cache, f"compress.algorithm={spec}", f"model.path={model}",
                 f"output_dir={out}")
    return res.returncode, res.stderr


def _eval_error(spec: str, model: Path, rules_dir: Path, cache: Path, out: Path,
                capsys) -> tuple[int, str]:
    code = eval_cli.main(_eval_args(out, str(model), spec))
    return code, capsys.readouterr().err


def _bench_error(spec: str, model: Path, rules_dir: Path, cache: Path, out: Path,
                 capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", "cpu", "--model", str(model), "--compress", spec])
    return exit_.value.code, capsys.readouterr().err


COMMANDS = {"train.py": ("error: ", _train_error), "eval.py": ("eval.py: error: ", _eval_error),
            "bench": ("error: ", _bench_error)}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", BAD_RULES)
def test_unusable_rule_exits_2_with_one_line_before_a_model_loads(
        command, case, rules_dir, user_path, tmp_path, _minisparse_cache, capsys):
    """The model is a folder that passes the path check but cannot load: had anything
    loaded it, its traceback would follow the line."""
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    spec, message = BAD_RULES[case]
    prefix, run = COMMANDS[command]
    code, err = run(spec, model, rules_dir, _minisparse_cache, tmp_path / "out", capsys)
    assert code == 2
    assert err.splitlines() == [f"{prefix}compress.algorithm={spec!r}: {message}"]


def test_scores_that_cannot_be_ranked_name_the_rule_in_one_line(user_path):
    """The docs promise a line naming what is wrong for bad inputs; a rule's bad output
    (scores of another shape, or an error of its own) ended in a traceback inside
    rule.py that did not name the rule."""
    keys, queries = make_inputs(h_kv=2, group=2, length=40, window=4)
    lengths = torch.tensor([40])
    for spec, message in [
        ("my_rules:OneShort", "OneShort.score_batch returned torch.float32 scores of shape "
                              "[1, 2, 39]; keys [1, 2, 40, 16] need floating-point scores "
                              "[B, H_kv, Lmax] = [1, 2, 40], one per cached key"),
        ("my_rules:Raises", f"Raises.score_batch raised KeyError: 'missing' (at "
                            f"{_raising_line(user_path)})"),
    ]:
        rule = build_rule(CompressConfig(algorithm=spec, budget=16, window=4))
        with pytest.raises(RuleError) as info:
            rule.select_batch(keys[None], queries[None], lengths)
        assert str(info.value) == f"compress.algorithm={spec!r}: {message}"


def _raising_line(rules_dir: Path) -> str:
    """my_rules.py:LINE of Raises.score_batch's raise: where the user's own error is."""
    path = rules_dir / "my_rules.py"
    line = path.read_text().splitlines().index('        raise KeyError("missing")') + 1
    return f"{path}:{line}"


def test_a_rule_that_raises_names_its_file_and_line_in_train_and_eval(
        rules_dir, user_path, tiny_path, tmp_path, _minisparse_cache, capsys):
    """The user's own error, raised deep in the engine's compaction: train.py said it in
    one line without the user's line, eval.py in a 61-line traceback."""
    spec = "my_rules:Raises"
    want = (f"compress.algorithm={spec!r}: Raises.score_batch raised KeyError: 'missing' "
            f"(at {_raising_line(rules_dir)})")
    res = _train(rules_dir, _minisparse_cache, f"compress.algorithm={spec}", "num_rollout=1",
                 "save_interval=0", f"output_dir={tmp_path / 'out'}")
    assert res.returncode == 1
    assert res.stderr.splitlines() == [f"error: {want}"]
    assert eval_cli.main(_eval_args(tmp_path / "eval", "tiny", spec)) == 1
    assert capsys.readouterr().err.splitlines() == [f"eval.py: error: {want}"]


def test_a_rule_that_fails_in_training_stops_it_in_one_line(rules_dir, tmp_path,
                                                            _minisparse_cache):
    res = _train(rules_dir, _minisparse_cache, "compress.algorithm=my_rules:OneShort",
                 "num_rollout=1", "save_interval=0", f"output_dir={tmp_path / 'out'}")
    assert res.returncode == 1
    (line,) = res.stderr.splitlines()
    assert line.startswith("error: compress.algorithm='my_rules:OneShort': "
                           "OneShort.score_batch returned torch.float32 scores of shape [")
