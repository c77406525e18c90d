"""train.py with LoRA (model.lora) end to end on CPU, the tiny model: only the adapters
train (the base stays bit for bit), the checkpoint's merged model is PEFT's merge of its
adapter onto the base, a killed run resumes exactly, and eval.py scores the saved model."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import signalled_after_rows

REPO = Path(__file__).resolve().parents[2]
RANK = 8
# entropy_coef > 0: every step has a gradient though the random tiny model earns no reward
ARGS = ["--config", "tiny_rkv", "--set", "loss.entropy_coef=0.01", "--set", "num_rollout=4",
        "--set", "save_interval=1", "--set", "log.tensorboard=false",
        "--set", "model.lora.enabled=true", "--set", f"model.lora.rank={RANK}"]
VOLATILE = ("time/", "mem/", "perf/", "reward/grade_s")
LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    return {**env, "MINISPARSE_CACHE": str(cache)}


def _cmd(out: Path, *args: str) -> list[str]:
    return [sys.executable, "train.py", *ARGS, "--set", f"output_dir={out}", *args]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _killed_after(out: Path, rows: int, cache: Path) -> int:
    """A run SIGKILLed as its metrics.jsonl reaches `rows` rows; its return code."""
    return signalled_after_rows(_cmd(out), REPO, _env(cache), rows).returncode


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _minisparse_cache):
    """(killed after rollout 2's row, then --resume; straight) output dirs, 4 rollouts."""
    base = tmp_path_factory.mktemp("lora")
    resumed, straight = base / "resumed", base / "straight"
    assert _killed_after(resumed, 2, _minisparse_cache) == -signal.SIGKILL
    for out, extra in ((resumed, ["--resume"]), (straight, [])):
        res = subprocess.run(_cmd(out, *extra), cwd=REPO, env=_env(_minisparse_cache),
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert ("resumed from" in res.stdout) == (out == resumed)
    return resumed, straight


def _final(out: Path) -> Path:
    return out / "checkpoints" / "rollout_000004"


def test_only_the_adapters_train_and_the_base_stays_bit_for_bit(runs, tiny_path):
    """hf/ holds exactly PEFT's merge of adapter/ onto the untouched base: had any base
    weight moved in training, merged = base + delta would not match; the adapters moved
    (lora_B starts at zero) and the optimizer holds fp32 masters for them alone."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = _final(runs[1])
    base = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, ckpt / "adapter").merge_and_unload().state_dict()
    saved = load_file(ckpt / "hf" / "model.safetensors")
    assert saved.keys() <= merged.keys()
    assert all(torch.equal(saved[k], merged[k]) for k in saved)
    assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"],
                           base_state["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(saved["model.embed_tokens.weight"], base_state["model.embed_tokens.weight"])
    adapter = load_file(ckpt / "adapter" / "adapter_model.safetensors")
    assert all(v.abs().max() > 0 for k, v in adapter.items() if ".lora_B." in k)
    trained = sum(v.numel() for v in adapter.values())
    assert trained == 2 * RANK * (128 + 96 + 96 + 128 + 192 + 192 + 192)  # tiny: 2 layers
    optim = torch.load(ckpt / "ds" / "state" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                       weights_only=False)
    masters = optim["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    assert sum(m.numel() for m in masters) == trained


def test_killed_lora_run_resumes_exactly(runs):
    """Every metrics row of the killed-and-resumed run equals the straight run's, and the
    final adapters are the same bit for bit."""
    from safetensors.torch import load_file

    resumed, straight = (_rows(d) for d in runs)
    assert [r["rollout"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, straight):
        same = {k: a[k] for k in a if not k.startswith(VOLATILE)}
        assert same == {k: b[k] for k in same}, a["rollout"]
    first, second = (load_file(_final(d) / "adapter" / "adapter_model.safetensors") for d in runs)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_eval_scores_the_saved_merged_model(runs, _minisparse_cache):
    res = subprocess.run([sys.executable, "eval.py", "--run", str(runs[1]), "--no-base",
                          "--limit", "4"], cwd=REPO, env=_env(_minisparse_cache),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((runs[1] / "eval/quick/rollout_000004/arithmetic/metrics.json")
                        .read_text())
    assert result["metrics"]["problems"] == 4


def test_the_ablation_script_has_a_lora_variant(tmp_path):
    """scripts/ablation.sh --variants "dense lora": full training against LoRA on
    SmolLM2's task, LoRA's rank and learning rate from LORA_RANK and LORA_LR."""
    res = subprocess.run(["bash", "scripts/ablation.sh", "--dry-run", "--seeds", "1",
                          "--variants", "dense lora", "--root", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "LORA_RANK": "8", "LORA_LR": "2e-4"})
    assert res.returncode == 0, res.stderr
    dense, lora = res.stdout.splitlines()
    assert "model.lora" not in dense and f"output_dir={tmp_path}/lora_seed1" in lora
    assert ("--config smollm2_dense --set model.lora.enabled=true --set model.lora.rank=8 "
            "--set optim.lr=2e-4 ") in lora
