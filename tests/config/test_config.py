import argparse
import dataclasses
import sys

import pytest

from minisparse.compression.trigger import check_compression_reach
from minisparse.config.schema import Config, ConfigError
from minisparse.config.cli import add_config_args, config_from_args
from minisparse.config.load import (
    check_training_config, config_to_dict, dump_config, load_config, resolve_config_path,
    shipped_configs,
)

SHIPPED = shipped_configs()


def test_defaults_are_valid():
    assert load_config() == Config()


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads(name):
    cfg = load_config(name)
    assert cfg.rollout_batch_size * cfg.n_samples_per_prompt == \
        cfg.global_batch_size * cfg.num_steps_per_rollout
    assert load_config(str(resolve_config_path(name))) == cfg
    check_compression_reach(cfg)  # what train.py checks: compression can run
    check_training_config(cfg)  # and that it can learn (temperature > 0)


def test_all_expected_configs_shipped():
    expected = {"qwen3b_rkv", "qwen3b_dense", "qwen3b_snapkv", "qwen1.5b_rkv",
                "qwen7b_rkv", "llama1b_rkv", "tiny_rkv", "tiny_dense", "smollm2_cpu",
                "smollm2_cpu_rkv", "qwen3b_dapo"}
    assert expected <= set(SHIPPED)


def test_qwen3b_rkv_has_paper_settings():
    c = load_config("qwen3b_rkv")
    assert (c.num_rollout, c.rollout_batch_size, c.n_samples_per_prompt) == (100, 128, 8)
    assert (c.max_response_len, c.temperature) == (4096, 1.0)
    assert (c.global_batch_size, c.num_steps_per_rollout, c.max_tokens_per_gpu) == (256, 4, 8192)
    assert (c.model.dtype, c.zero_stage, c.save_interval) == ("bfloat16", "auto", 10)
    assert c.data.path == "data/simplelr_qwen_level3to5.jsonl" and c.data.shuffle
    assert (c.data.input_key, c.data.label_key) == ("prompt", "label")
    assert (c.loss.advantage, c.loss.kl_type, c.loss.kl_coef) == ("grpo", "low_var_kl", 1e-4)
    assert (c.loss.entropy_coef, c.loss.eps_clip) == (0.0, 0.2)
    assert (c.optim.lr, c.optim.lr_schedule, c.optim.weight_decay) == (1e-6, "constant", 0.1)
    assert (c.optim.adam_beta1, c.optim.adam_beta2, c.optim.grad_clip) == (0.9, 0.98, 1.0)
    comp = c.compress
    assert (comp.algorithm, comp.budget, comp.window) == ("rkv", 512, 8)
    assert (comp.divide_method, comp.divide_length) == ("step_length", 128)
    assert load_config("llama1b_rkv").data.path == "data/simplelr_level3to5.jsonl"
    loss = c.loss
    assert loss.use_tis and loss.use_rs and loss.normalize_weights
    assert (loss.tis_level, loss.tis_mode, loss.tis_upper, loss.tis_lower) == \
        ("token", "truncate", 1.5, 0.5)
    assert (loss.rs_lower, loss.rs_upper, loss.rs_veto_threshold) == (0.5, 1.5, 1e-4)


# The paper's configs (qwen3b_rkv and those naming it as base); coder1.5b keeps one
# checkpoint of its shorter runs.
PAPER = [name for name in SHIPPED if name.startswith(("qwen", "llama"))]


def test_smollm2_configs_read_the_model_where_download_writes_it():
    """`python -m minisparse.download --model smollm2-135m-instruct --out checkpoints/`
    (the design's proportions: tests/config/test_smollm2_configs.py)."""
    from minisparse.models.gguf import MODELS

    for name in ("smollm2_dense", "smollm2_rkv", "smollm2_cpu", "smollm2_cpu_rkv"):
        assert load_config(name).model.path == f"checkpoints/{next(iter(MODELS))}"


def test_cpu_quick_start_keeps_work_in_little_memory_and_disk():
    """A Ctrl-C loses at most 3 rollouts, one checkpoint is kept, and without ZeRO in
    float32 the state is weights, gradients and AdamW's moments only (docs/memory.md)."""
    for name in ("smollm2_cpu", "smollm2_cpu_rkv"):
        cfg = load_config(name)
        assert (cfg.save_interval, cfg.save_total_limit) == (3, 1)
        assert (cfg.zero_stage, cfg.max_tokens_per_gpu, cfg.cpu_threads) == (0, 512, 0)


def test_cpu_quick_start_runs_in_float32_on_easy_sums():
    """bf16 matmuls are slower on most CPUs; sums of single digits are learnt in minutes."""
    for name, algorithm in (("smollm2_cpu", "none"), ("smollm2_cpu_rkv", "rkv")):
        cfg = load_config(name)
        assert (cfg.model.dtype, cfg.compress.algorithm) == ("float32", algorithm)
        assert cfg.data.synthetic_max_operand == 9 and cfg.reward.overlong_buffer == 32


@pytest.mark.parametrize("name", PAPER)
def test_paper_configs_keep_few_checkpoints_and_read_data_dir(name):
    """Data where `python -m minisparse.download --out data/` writes it, inside the
    checkout (test_download checks the file name); older checkpoints are deleted: the
    paper's jobs keep two, the real-model ablation (four runs a machine) one a run."""
    cfg = load_config(name)
    assert cfg.save_total_limit == (1 if name.startswith("coder") else 2)
    assert cfg.data.path.startswith("data/") and cfg.data.path.endswith(".jsonl")
    assert Config().save_total_limit is None  # the default keeps every checkpoint


def test_overrides_parse_types():
    c = load_config("tiny_rkv", [
        "compress.budget=32", "num_rollout=2", "optim.lr=3e-5", "loss.use_tis=false",
        "eval.benchmarks=gsm8k,math500", "eval.limit=null", "log.run_name=yes",
        "compress.max_buffer=64", "model.path=123",
    ])
    assert (c.compress.budget, c.num_rollout, c.optim.lr) == (32, 2, 3e-5)
    assert c.loss.use_tis is False and c.eval.limit is None
    assert c.eval.benchmarks == ["gsm8k", "math500"]
    assert c.log.run_name == "yes" and c.model.path == "123"  # str keys keep raw text
    assert load_config(None, ["eval.benchmarks=[aime24]"]).eval.benchmarks == ["aime24"]
    assert load_config(None, ["optim.lr=1"]).optim.lr == 1.0  # int accepted for float


def test_auto_true_false_keys_take_yaml_booleans(tmp_path):
    """model.gradient_checkpointing and optimizer_offload: auto (the memory plan decides)
    by default; YAML's true/false and --set's true/True/false read as the strings."""
    assert (Config().model.gradient_checkpointing, Config().optimizer_offload) == ("auto", "auto")
    path = tmp_path / "c.yaml"
    path.write_text("optimizer_offload: false\nmodel:\n  gradient_checkpointing: true\n")
    c = load_config(str(path))
    assert (c.model.gradient_checkpointing, c.optimizer_offload) == ("true", "false")
    c = load_config(None, ["model.gradient_checkpointing=True", "optimizer_offload=auto"])
    assert (c.model.gradient_checkpointing, c.optimizer_offload) == ("true", "auto")
    assert load_config(str(path)) == load_config(None, [
        "optimizer_offload=false", "model.gradient_checkpointing=true"])
    assert load_config(None, ["gpu_memory_gb=80"]).gpu_memory_gb == 80.0


def test_zero_stage_is_auto_or_a_number(tmp_path):
    """zero_stage: auto (the memory plan picks 1 or 2) by default; a number from YAML or
    --set stays a number, as DeepSpeed takes it."""
    assert Config().zero_stage == "auto"
    path = tmp_path / "c.yaml"
    path.write_text("zero_stage: 1\n")
    assert load_config(str(path)).zero_stage == 1
    assert load_config(None, ["zero_stage=3"]).zero_stage == 3
    assert load_config(str(path), ["zero_stage=auto"]).zero_stage == "auto"
    with pytest.raises(ConfigError, match="'zero_stage' must be one of auto, 0, 1, 2, 3; got 'true'"):
        load_config(None, ["zero_stage=true"])
    path.write_text("zero_stage: true\n")
    with pytest.raises(ConfigError, match="'zero_stage' expects one of auto, 0, 1, 2, 3, got True"):
        load_config(str(path))


@pytest.mark.parametrize("override,message", [
    ("model.gradient_checkpointing=sometimes",
     "'model.gradient_checkpointing' must be one of auto, true, false; got 'sometimes'"),
    ("optimizer_offload=1",
     "'optimizer_offload' must be one of auto, true, false, cpu_adam; got '1'"),
    ("gpu_memory_gb=-1", "'gpu_memory_gb' must be >= 0, got -1"),
    ("compress.budgett=3", "unknown config key 'compress.budgett' (did you mean 'compress.budget'?)"),
    ("num_rolout=3", "did you mean 'num_rollout'"),
    # a section's key given without its section: spelt right, placed wrong
    ("lr=1e-5", "unknown config key 'lr' (did you mean 'optim.lr'?)"),
    ("budget=64", "unknown config key 'budget' (did you mean 'compress.budget'?)"),
    ("optim.lr=true", "'optim.lr' expects float, got True"),
    ("optim.lr=fast", "'optim.lr' expects float, got 'fast'"),
    ("optim.lr=.inf", "'optim.lr' expects a finite number, got inf"),
    ("optim.lr=nan", "'optim.lr' expects a finite number, got nan"),
    ("num_rollout=true", "'num_rollout' expects int, got True"),
    ("num_rollout=2.5", "'num_rollout' expects int, got 2.5"),
    ("model.dtype=fp8", "'model.dtype' must be one of bfloat16, float16, float32; got 'fp8'"),
    ("compress.algorithm=h2o",
     "'compress.algorithm' must be none, a shipped rule (knorm, rkv, snapkv, streaming_llm) "
     "or module.path:ClassName, got 'h2o'"),
    ("compress.algorithm=my_rules", "or module.path:ClassName, got 'my_rules'"),
    ("compress.algorithm=my_rules:", "or module.path:ClassName, got 'my_rules:'"),
    ("compress.algorithm=my rules:R", "or module.path:ClassName, got 'my rules:R'"),
    ("loss.tis_mode=cap", "'loss.tis_mode' must be one of truncate, clip, mask"),
    ("resume=always", "'resume' must be one of auto, never"),
    ("compress.window=0", "'compress.window' must be >= 1, got 0"),
    ("save_total_limit=0", "'save_total_limit' must be >= 1, got 0"),
    ("zero_stage=4", "'zero_stage' must be one of auto, 0, 1, 2, 3; got 4"),
    ("zero_stage=one", "'zero_stage' must be one of auto, 0, 1, 2, 3; got 'one'"),
    ("top_p=0", "'top_p' must be in (0, 1], got 0"),
    ("temperature=-0.1", "'temperature' must be >= 0, got -0.1"),
    ("optim.adam_eps=-1", "'optim.adam_eps' must be >= 0"),
    ("compress.mix_lambda=1.5", "'compress.mix_lambda' must be in [0, 1], got 1.5"),
    ("compress.sim_threshold=2.0", "'compress.sim_threshold' must be in [-1, 1], got 2.0"),
    ("compress.kernel_size=4", "'compress.kernel_size' must be odd and >= 1, got 4"),
    ("compress.kernel_size=0", "'compress.kernel_size' must be odd and >= 1, got 0"),
    ("compress.pooling=mean", "'compress.pooling' must be one of max, avg; got 'mean'"),
    ("compress.group_pooling=avg", "'compress.group_pooling' must be one of max, mean"),
    ("compress.selection=global", "'compress.selection' must be one of per_head, per_layer"),
    ("compress.divide_method=paragraph",
     "'compress.divide_method' must be one of step_length, newline; got 'paragraph'"),
    ("compress.divide_method=none", "'compress.divide_method' must be one of step_length"),
    ("compress.divide_length=0", "'compress.divide_length' must be >= 1, got 0"),
    ("compress.max_buffer=0", "'compress.max_buffer' must be >= 1, got 0"),
    ("reward.workers=-1", "'reward.workers' must be >= 0, got -1"),
    ("reward.overlong_buffer=-1", "'reward.overlong_buffer' must be >= 0, got -1"),
    ("reward.overlong_buffer=999",
     "'reward.overlong_buffer' (999) must be <= 'max_response_len' (48)"),
    ("loss.tis_lower=2", "'loss.tis_lower' (2.0) must be <= 'loss.tis_upper' (1.5)"),
    ("loss.rs_upper=0.4", "'loss.rs_lower' (0.5) must be <= 'loss.rs_upper' (0.4)"),
    ("compress.budget=4", "'compress.budget' (4) must be > 'compress.window' (4)"),
    ("global_batch_size=4",
     "(4 * 4 = 16) must equal global_batch_size * num_steps_per_rollout (4 * 2 = 8)"),
    ("compress", "must look like KEY=VALUE"),
    ("compress=3", "'compress' is a section"),
    ("eval.benchmarks=[1, 2]", "'eval.benchmarks' expects list of str"),
    ("data.synthetic_operators=+,/",
     "'data.synthetic_operators' must be a non-empty list of +, -, *; got ['+', '/']"),
    ("data.synthetic_operators=[]", "'data.synthetic_operators' must be a non-empty list"),
    ("data.synthetic_max_operand=0", "'data.synthetic_max_operand' must be >= 1, got 0"),
    ("data.synthetic_operations=0", "'data.synthetic_operations' must be >= 1, got 0"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as info:
        load_config("tiny_rkv", [override])
    assert message in str(info.value)


def test_a_rule_of_ones_own_is_checked_by_its_form_alone():
    """config/ imports no rule (the compression layer's check_rule does, before a model
    loads): module.path:ClassName loads whether or not that module exists."""
    cfg = load_config("tiny_rkv", ["compress.algorithm=my_pkg.rules:MyRule"])
    assert cfg.compress.algorithm == "my_pkg.rules:MyRule" and "my_pkg" not in sys.modules


def test_greedy_training_is_refused_but_greedy_eval_loads():
    """temperature 0 makes a prompt's samples identical: every GRPO group zero-signal. It
    is train.py's check alone; eval.py loads the same configs (load_config) to decode
    greedily (eval.temperature 0), and a training config's own keys come along."""
    cfg = load_config("tiny_rkv", ["temperature=0", "eval.temperature=0"])
    with pytest.raises(ConfigError) as info:
        check_training_config(cfg)
    assert str(info.value) == (
        "config key 'temperature' is 0 (greedy): the n_samples_per_prompt samples of a prompt "
        "would all be the same, so no group could tell a better response from a worse one, and "
        "greedy outputs are not samples of the policy the update assumes; training needs "
        "temperature > 0 (1.0 samples the policy as it is; eval.temperature may be 0)")
    check_training_config(load_config("tiny_rkv", ["temperature=0.01", "eval.temperature=0"]))


@pytest.mark.parametrize("truncation", [["top_p=0.9"], ["top_k=20"]])
def test_truncated_sampling_trains_on_the_native_engine_only(truncation):
    """The native sampler's log-probs are those of the truncated, renormalised law it drew
    from (tests/engine/test_sampling.py); SGLang's are not, so training refuses that pair
    and names both ways out."""
    check_training_config(load_config("tiny_dense", truncation))
    with pytest.raises(ConfigError, match="engine.backend=sglang: SGLang returns log-probs "
                                          "of the untruncated distribution") as info:
        check_training_config(load_config("tiny_dense", truncation + ["engine.backend=sglang"]))
    assert "engine.backend=native" in str(info.value) and "top_p=1.0" in str(info.value)
    check_training_config(load_config("tiny_dense", ["engine.backend=sglang"]))


def test_budget_may_be_small_when_compression_off():
    assert load_config("tiny_dense", ["compress.budget=2"]).compress.budget == 2


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("compress:\n  budgett: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'compress.budget'"):
        load_config(str(bad))
    bad.write_text("compress: 3\n")
    with pytest.raises(ConfigError, match="section 'compress' must be a mapping"):
        load_config(str(bad))
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="available configs: .*tiny_rkv"):
        load_config("no_such_config")


@pytest.mark.parametrize("text", ["", "# all comments\n", "{}\n"])
def test_an_empty_config_file_is_refused(tmp_path, text):
    """It was taken silently as every default: 100 rollouts of 128 x 8 x 4,096 tokens."""
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(empty))
    assert str(info.value) == (
        f"config {empty} sets nothing: it would run every default (100 rollouts of 128 "
        f"prompts x 8 samples of up to 4096 tokens); set the keys you mean, or start from a "
        f"shipped config with a line such as 'base: tiny_rkv'")
    empty.write_text("base: tiny_rkv\n")  # a base alone is a config
    assert load_config(str(empty)) == load_config("tiny_rkv")


def test_a_home_folder_in_a_path_is_expanded(tmp_path, monkeypatch):
    """YAML and --set pass ~ on as written; no file is named ~."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config("tiny_rkv", ["data.path=~/d.jsonl", "output_dir=~/runs/a",
                                   "model.path=~/models/m", "eval.data_dir=~/eval"])
    assert (cfg.data.path, cfg.output_dir, cfg.model.path, cfg.eval.data_dir) == (
        f"{tmp_path}/d.jsonl", f"{tmp_path}/runs/a", f"{tmp_path}/models/m", f"{tmp_path}/eval")
    assert load_config("tiny_rkv", ["data.path=data/~x.jsonl"]).data.path == "data/~x.jsonl"
    yaml_file = tmp_path / "mine.yaml"
    yaml_file.write_text("base: tiny_rkv\ndata:\n  path: ~/d.jsonl\n")
    assert load_config(str(yaml_file)).data.path == f"{tmp_path}/d.jsonl"


def test_dump_roundtrip(tmp_path):
    cfg = load_config("qwen3b_rkv", ["eval.benchmarks=gsm8k", "compress.max_buffer=512"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)) == cfg
    assert dataclasses.asdict(cfg) == config_to_dict(cfg)


def _parse(argv):
    return add_config_args(argparse.ArgumentParser()).parse_args(argv)


def test_cli_helpers(capsys, monkeypatch):
    cfg = config_from_args(_parse(["--config", "tiny_rkv", "--set", "num_rollout=7",
                                   "--set", "compress.budget=20"]))
    assert (cfg.num_rollout, cfg.compress.budget) == (7, 20)
    with pytest.raises(SystemExit) as info:
        config_from_args(_parse(["--config", "tiny_rkv", "--print-config"]))
    assert info.value.code == 0
    printed = capsys.readouterr().out
    assert "num_rollout: 3" in printed and "algorithm: rkv" in printed
    with pytest.raises(SystemExit) as info:
        config_from_args(_parse(["--set", "compress.budgett=1"]))
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown config key")
    monkeypatch.setenv("RANK", "1")  # torchrun's other processes: the same exit, no line
    with pytest.raises(SystemExit) as info:
        config_from_args(_parse(["--set", "compress.budgett=1"]))
    assert info.value.code == 2 and capsys.readouterr().err == ""
