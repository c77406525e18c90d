"""optimizer_offload=cpu_adam: DeepSpeed ZeRO-Offload's CPU Adam (the optimizer's state and
step on the CPU). Its op JIT-builds with g++, ninja and Python's headers (~1-2 minutes on
first use, cached in TORCH_EXTENSIONS_DIR); where it cannot build these tests skip naming
what is missing."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from spawned_ranks import spawned_rank

from minisparse.trainer.train_engine import cpu_adam_missing, deepspeed_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cpu_adam():
    """DeepSpeedCPUAdam, once its op builds (skip: what the build needs, or why it failed)."""
    missing = cpu_adam_missing()
    if missing:
        pytest.skip(f"DeepSpeed's CPU Adam op cannot build here: needs {missing}")
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
    except Exception as error:  # noqa: BLE001 (a compiler's or linker's failure)
        pytest.skip(f"DeepSpeed's CPU Adam op did not build: {str(error).splitlines()[0]}")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam


def test_one_step_by_hand(cpu_adam):
    """AdamW's first step moves each weight by lr x m/(sqrt(v) + eps) = lr x sign(g), after
    decoupled weight decay lr x wd x w: from 1, lr 0.1, wd 0.01, 1 - 0.001 -+ 0.1 = 0.899 /
    1.099. The same as torch's AdamW, and again after a second step."""
    grads = [torch.tensor([1.0, -1.0, 2.0, 0.5]), torch.tensor([0.5, 0.5, -3.0, 0.0])]
    weights = []
    for make in (lambda p: cpu_adam([p], lr=0.1, weight_decay=0.01, adamw_mode=True),
                 lambda p: torch.optim.AdamW([p], lr=0.1, weight_decay=0.01)):
        p = torch.nn.Parameter(torch.ones(4))
        opt = make(p)
        for k, g in enumerate(grads):
            p.grad = g.clone()
            opt.step()
            if k == 0:
                torch.testing.assert_close(p.detach(), torch.tensor([0.899, 1.099, 0.899, 0.899]))
        weights.append(p.detach().clone())
    torch.testing.assert_close(weights[0], weights[1])


def test_deepspeed_config_offloads_the_optimizer():
    from minisparse.config.load import load_config

    cfg = load_config("tiny_rkv", ["optimizer_offload=cpu_adam"])
    zero = deepspeed_config(cfg, on_gpu=True)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_optimizer" not in deepspeed_config(load_config("tiny_rkv"), True)[
        "zero_optimization"]


def _engine_worker(rank: int, init_file: str, out: str, stage: int) -> None:
    """Two optimizer steps of 3 micro-batches each through build_train_engine under
    cpu_adam, and the same on a copy with torch's AdamW and plain backward()."""
    import copy

    from transformers import AutoModelForCausalLM, Qwen2Config

    from minisparse.config.load import load_config
    from minisparse.trainer.memory.phases import TrainingStateOffload
    from minisparse.trainer.train_engine import build_train_engine, make_optimizer

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    with spawned_rank(0, 1, init_file):
        sets = ["optim.lr=1e-2", "optim.weight_decay=0.1", "optim.grad_clip=0",
                "model.dtype=float32"]
        cfg = load_config("tiny_rkv", [*sets, "optimizer_offload=cpu_adam", f"zero_stage={stage}"])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256), dtype=torch.float32)
        plain = copy.deepcopy(model)
        engine = build_train_engine(model, cfg, 10, torch.device("cpu"))
        reference = make_optimizer(plain, load_config("tiny_rkv", sets), on_gpu=False)
        tokens = torch.Generator().manual_seed(1)
        for _ in range(2):
            for _ in range(3):
                ids = torch.randint(0, 256, (1, 16), generator=tokens)
                engine.backward(engine.module(input_ids=ids).logits.square().mean(),
                                scale_wrt_gas=False)
                plain(input_ids=ids).logits.square().mean().backward()
            engine.step()
            reference.step()
            reference.zero_grad()
        flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        assert isinstance(engine.optimizer.optimizer, DeepSpeedCPUAdam)
        torch.save({"cpu_adam": flat(engine.module), "adamw": flat(plain),
                    "optimizer": type(engine.optimizer.optimizer).__name__,
                    "offloaded": engine.zero_cpu_offload(),
                    "swaps": TrainingStateOffload(engine).active}, out)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_engine_steps_as_torch_adamw(cpu_adam, tmp_path, stage):
    """ZeRO 1 and 2 with the optimizer on the CPU (unmanaged accumulation: a backward per
    micro-batch, a step per optimizer step) move the weights as torch's AdamW does on the
    same summed gradients; the phase swaps leave its state alone."""
    import torch.multiprocessing as mp

    out = tmp_path / "weights.pt"
    mp.spawn(_engine_worker, args=(str(tmp_path / "init"), str(out), stage), nprocs=1)
    got = torch.load(out)
    assert got["optimizer"] == "CPUAdamW" and got["offloaded"] and not got["swaps"]
    torch.testing.assert_close(got["cpu_adam"], got["adamw"], rtol=0, atol=1e-5)


def test_tiny_training_run_with_cpu_adam(cpu_adam, tmp_path):
    """train.py on the tiny model with optimizer_offload=cpu_adam, planned for a 1 GB GPU:
    the plan's first line names CPU Adam and its host memory, a rollout trains, and the
    checkpoint's DeepSpeed config has the optimizer on the CPU."""
    out = tmp_path / "out"
    args = [a for s in (f"output_dir={out}", "resume=never", "num_rollout=1", "save_interval=1",
                        "gpu_memory_gb=1", "optimizer_offload=cpu_adam") for a in ("--set", s)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    res = subprocess.run([sys.executable, "train.py", "--config", "tiny_rkv", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=900, check=False, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    head = res.stdout.splitlines()[0]
    assert "ZeRO 2" in head and "optimizer on the CPU (DeepSpeed CPU Adam, " \
                                "optimizer_offload=cpu_adam): host memory" in head
    plan = json.loads((out / "memory_plan.json").read_text())
    assert plan["cpu_adam"] and plan["zero_stage"] == 2
    (states,) = out.glob("checkpoints/*/ds/state/mp_rank_00_model_states.pt")
    ds = torch.load(states, weights_only=False)["ds_config"]["zero_optimization"]
    assert ds["offload_optimizer"]["device"] == "cpu"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["train/grad_norm"] > 0


def _resume_worker(rank: int, init_file: str, folder: str, first: str, second: str) -> None:
    """One step under `first`, a checkpoint, a resume under `second` and one more step,
    beside two steps under `first` alone: the same weights."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from minisparse.config.load import load_config
    from minisparse.trainer.train_engine import build_train_engine

    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")

    def engine(offload: str):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Qwen2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256), dtype=torch.float32)
        cfg = load_config("tiny_rkv", ["model.dtype=float32", "optim.lr=1e-2",
                                       f"optimizer_offload={offload}"])
        return build_train_engine(model, cfg, 10, torch.device("cpu"))

    def step(e, k: int) -> None:
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(k))
        e.backward(e.module(input_ids=ids).logits.square().mean(), scale_wrt_gas=False)
        e.step()

    with spawned_rank(0, 1, init_file):
        alone = engine(first)
        step(alone, 0), step(alone, 1)
        before = engine(first)
        step(before, 0)
        before.save_checkpoint(folder, tag="one")
        after = engine(second)
        after.load_checkpoint(folder, tag="one")
        step(after, 1)
        flat = lambda e: torch.cat([p.detach().flatten() for p in e.module.parameters()])  # noqa: E731
        torch.save({"alone": flat(alone), "resumed": flat(after)}, f"{folder}/weights.pt")


@pytest.mark.parametrize("first,second", [("false", "cpu_adam"), ("cpu_adam", "false")])
def test_a_checkpoint_resumes_across_the_optimizers(cpu_adam, tmp_path, first, second):
    """optimizer_offload may change on resume (a run moved to a GPU of another size, whose
    plan chooses otherwise): torch AdamW's checkpoint resumes under CPU Adam and back,
    moments and step count kept."""
    import torch.multiprocessing as mp

    mp.spawn(_resume_worker, args=(str(tmp_path / "init"), str(tmp_path), first, second),
             nprocs=1)
    got = torch.load(tmp_path / "weights.pt")
    torch.testing.assert_close(got["resumed"], got["alone"], rtol=0, atol=1e-5)
