"""What a run says at start, at the end, and instead of redoing a finished run."""
import json

import pytest

from minisparse.compression import rule_class
from minisparse.config.load import load_config, shipped_configs
from minisparse.config.schema import ConfigError, rule_names
from minisparse.trainer.checkpoint import MARKER
from minisparse.trainer.run_config import record_config
from minisparse.trainer.report import (cache_line, config_menu, end_report,
                                    finished_message, no_config_message, start_report,
                                    continue_command, interrupted_report, peer_lost_report,
                                    stop_report)


def _checkpoint(out, rollout):
    d = out / "checkpoints" / f"rollout_{rollout:06d}"
    (d / "hf").mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"rollout": rollout}))
    (d / MARKER).write_text("done\n")
    return d


LEGEND = "each rollout's line: reward = mean reward,\n  time = seconds per phase"


def test_start_names_config_model_device_rollouts_cache_and_outputs():
    cfg = load_config("tiny_rkv", ["num_rollout=5"])
    text = start_report(cfg, "tiny_rkv", ["num_rollout=5"], "cpu", 1, 2, 30, LEGEND)
    lines = text.splitlines()
    assert lines[0] == "config: tiny_rkv, with num_rollout=5"
    assert lines[1].startswith("model: tiny, float32: random weights")
    assert "reward and accuracy stay 0" in lines[1]
    assert lines[2] == "device: cpu, 1 process"
    assert lines[3].startswith("rollouts: 3, 3 to 5 (resumed after rollout 2); each 4 "
                               "prompts x 4 samples of up to 48 tokens")
    # prompt 30 > budget 16 + divide_length 8: compressed as soon as it is read
    assert lines[4] == ("rollout KV cache: R-KV, 16 tokens kept, compressed every 8 tokens; "
                        "the longest prompt (30 tokens) is compressed once read")
    assert lines[5] == ("outputs: outputs/tiny_rkv (metrics.jsonl, tensorboard/, a checkpoint "
                        "every rollout and at the end)")
    # the per-rollout line's columns, in plain words, once: the loop's legend, last
    assert lines[6:] == LEGEND.splitlines()


def test_a_cpu_run_says_its_threads_and_memory_after_the_device():
    cfg = load_config("tiny_rkv")
    machine = ["threads: 1 (2 physical cores, 1.0 busy with other work); change with ...",
               "memory: about 0.5 GiB resident at its peak, in the rollout (...)"]
    lines = start_report(cfg, "tiny_rkv", [], "cpu", 1, 0, 30, LEGEND, machine).splitlines()
    assert lines[2:5] == ["device: cpu, 1 process", *machine]
    assert lines[5].startswith("rollouts: 3, 1 to 3")


def test_random_weights_under_a_reward_of_your_own_promise_no_zero():
    """A reward.function may pay random text (test_train.py's parity reward does)."""
    for path in ("tiny", "qwen2.5-3b"):
        cfg = load_config("tiny_rkv", [f"model.path={path}", "reward.function=my:reward"])
        line = start_report(cfg, "tiny_rkv", [], "cpu", 1, 0, 30, LEGEND).splitlines()[1]
        assert "stay 0" not in line
        assert "random weights" in line and ("so its answers stay wrong (reward.function "
                                             "scores them as it will)") in line


def test_start_of_a_real_model_dense_run():
    cfg = load_config("smollm2_dense")
    text = start_report(cfg, "smollm2_dense", [], "cuda:0", 4, 0, 59, LEGEND)
    assert "model: checkpoints/smollm2-135m-instruct, bfloat16" in text
    assert "random" not in text
    assert "device: cuda:0, 4 processes" in text
    assert "rollout KV cache: dense (no compression)" in text
    cfg = load_config("smollm2_rkv", ["compress.budget=80", "compress.divide_length=16"])
    text = start_report(cfg, "smollm2_rkv", [], "cpu", 1, 0, 59, LEGEND)
    # budget 80, every 16: past the budget at 22 tokens, due at the batch's step 32
    assert "the first compression comes 32 tokens into a response (longest prompt, 59" in text
    cfg = load_config("smollm2_rkv", ["compress.keep_prompt=true", "compress.budget=80",
                                      "compress.divide_length=16"])
    text = start_report(cfg, "smollm2_rkv", [], "cpu", 1, 0, 59, LEGEND)
    # the prompt stays and counts for nothing: past the budget at 81 response tokens, due
    # at the batch's step 96
    assert ("rollout KV cache: R-KV, the prompt + 80 response tokens kept, compressed every "
            "16 tokens; the first compression comes 96 tokens into a response") in text


def test_end_names_outputs_newest_model_and_plot_command(tmp_path):
    out = tmp_path / "run"
    cfg = load_config("tiny_rkv", [f"output_dir={out}"])
    _checkpoint(out, 2)
    newest = _checkpoint(out, 3)
    text = end_report(cfg, 0.5)
    assert text.splitlines()[0] == f"finished 3 rollouts in 0.5 min; outputs in {out}/:"
    one = load_config("tiny_rkv", [f"output_dir={out}", "num_rollout=1"])
    assert end_report(one, 0.5).startswith("finished 1 rollout in 0.5 min")
    # after a resume: what this process ran, not the run's total (8 of 12 in 13.7 min)
    twelve = load_config("tiny_rkv", [f"output_dir={out}", "num_rollout=12"])
    assert end_report(twelve, 13.7, start_rollout=4).splitlines()[0] == (
        f"finished rollouts 5 to 12 (8 in this run, resumed after rollout 4) in 13.7 min; "
        f"outputs in {out}/:")
    assert f"tensorboard --logdir {out / 'tensorboard'}" in text
    assert f"  {(newest / 'hf').relative_to(out)}/  the trained model" in text
    assert text.splitlines()[-2].startswith(f"plot: python -m minisparse.plot {out}")
    assert text.splitlines()[-1].startswith(f"score it: python eval.py --run {out}  (")


def test_finished_run_says_so_and_how_to_go_on(tmp_path):
    out = tmp_path / "run"
    cfg = load_config("tiny_rkv", [f"output_dir={out}"])
    assert finished_message(cfg) is None  # nothing there yet
    _checkpoint(out, 2)
    assert finished_message(cfg) is None  # rollout 3 still to do
    _checkpoint(out, 3)
    text = finished_message(cfg)
    assert f"{out} already holds a finished run: 3 of 3 rollouts" in text
    assert "--set num_rollout=6" in text and "--set output_dir=" in text
    more = load_config("tiny_rkv", [f"output_dir={out}", "num_rollout=4"])
    assert finished_message(more) is None  # resumes
    fewer = load_config("tiny_rkv", [f"output_dir={out}", "num_rollout=2"])
    assert (f"{out} already holds a finished run: 3 rollouts, past the 2 this config asks "
            f"for (checkpoint ") in finished_message(fewer)
    fresh = load_config("tiny_rkv", [f"output_dir={out}", "resume=never"])
    assert finished_message(fresh) is None  # starts again, as asked


def test_a_finished_run_with_other_settings_is_refused(tmp_path):
    out = tmp_path / "run"
    cfg = load_config("tiny_rkv", [f"output_dir={out}"])
    _checkpoint(out, 3)
    assert "already holds a finished run" in finished_message(cfg)  # nothing recorded: as before
    record_config(cfg)
    assert "already holds a finished run" in finished_message(cfg)  # the same settings
    for sets, change, folder in [
        (["compress.algorithm=knorm"], "compress.algorithm rkv -> knorm", "run_knorm"),
        (["dynamic_sampling=true"], "dynamic_sampling false -> true", "run_dynamic_sampling"),
        (["loss.advantage=gspo", "seed=1", "compress.budget=32", "optim.lr=0.5"],
         "seed 42 -> 1, compress.budget 16 -> 32, optim.lr 0.0001 -> 0.5 and 1 more",
         "run_seed1"),
    ]:
        other = load_config("tiny_rkv", [f"output_dir={out}", *sets])
        with pytest.raises(ConfigError) as info:
            finished_message(other)
        assert str(info.value) == (
            f"{out} holds a run trained with other settings ({change}); to train this one, "
            f"give it its own folder: --set output_dir={out.parent / folder}")
    # what may change on resume (RESUMABLE_KEYS) does not count
    same = load_config("tiny_rkv", [f"output_dir={out}", "engine.max_num_seqs=8",
                                    "save_interval=0", "eval.limit=3", "log.tensorboard=false"])
    assert "already holds a finished run" in finished_message(same)


def test_no_config_lists_every_shipped_config():
    text = no_config_message()
    assert "no --config given" in text and "tiny_rkv" in text and "smollm2_cpu" in text
    menu = config_menu().splitlines()
    assert [line.split()[0] for line in menu] == shipped_configs()
    assert "tiny (random weights), R-KV 16, 3 rollouts of 4 x 4" in config_menu()


@pytest.mark.parametrize("algorithm", rule_names())
def test_cache_line_names_every_shipped_rule_by_its_own_name(algorithm):
    cfg = load_config("tiny_rkv", [f"compress.algorithm={algorithm}"])
    assert cache_line(cfg, 30).startswith(
        f"rollout KV cache: {rule_class(algorithm).name}, 16 tokens kept, compressed every 8")


def test_a_stop_names_what_is_saved_and_the_command_that_continues(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("sys.argv", ["train.py", "--config", "tiny_rkv", "--set",
                                     f"output_dir={tmp_path}"])
    cfg = load_config("tiny_rkv", [f"output_dir={tmp_path}"])
    command = f"python train.py --config tiny_rkv --set output_dir={tmp_path}"
    assert continue_command(cfg) == command
    assert interrupted_report(cfg, "Ctrl-C", None) == (
        f"stopped by Ctrl-C during set-up; nothing saved yet; to start again: {command}")
    newest = _checkpoint(tmp_path, 4)
    assert interrupted_report(cfg, "Ctrl-C", 5) == (
        f"stopped by Ctrl-C in rollout 5; saved: {newest} (rollout 4); to continue from it: "
        f"{command}")
    never = load_config("tiny_rkv", ["resume=never"])  # would start over: resume=auto added
    assert continue_command(never).endswith(" --set resume=auto")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # a torchrun worker
    assert continue_command(cfg).startswith("torchrun --nproc_per_node 4 train.py --config")


def test_a_stop_or_a_lost_rank_names_the_checkpoint_and_the_command(tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr("sys.argv", ["train.py", "--config", "tiny_rkv"])
    cfg = load_config("tiny_rkv", [f"output_dir={tmp_path}", "num_rollout=9"])
    assert stop_report(cfg, "SIGTERM", 0, 1, 0.5) == (
        "stopped by SIGTERM in rollout 1 of 9 (dropped before its update; a resume redoes "
        "it) after 0.5 min; nothing saved yet; to start again: python train.py --config "
        "tiny_rkv")
    newest = _checkpoint(tmp_path, 4)
    assert stop_report(cfg, "Ctrl-C", 4, None, 2.0) == (
        f"stopped by Ctrl-C after rollout 4 of 9 after 2.0 min; saved: {newest} (rollout 4); "
        f"to continue from it: python train.py --config tiny_rkv")
    assert peer_lost_report(cfg, "rank 1 (b)", "went silent", 5) == (
        f"error: rank 1 (b) went silent; the run stopped in rollout 5; saved: {newest} "
        f"(rollout 4); to continue from it: python train.py --config tiny_rkv")
    # a node of several under torchrun: its own node rank, the rendezvous address
    for key, value in (("LOCAL_WORLD_SIZE", "8"), ("GROUP_WORLD_SIZE", "2"), ("GROUP_RANK", "1"),
                       ("MASTER_ADDR", "node-a"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(key, value)
    assert continue_command(cfg) == ("torchrun --nnodes 2 --node_rank 1 --nproc_per_node 8 "
                                     "--master_addr node-a --master_port 29500 train.py "
                                     "--config tiny_rkv")
