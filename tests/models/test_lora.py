"""LoRA through PEFT (models/lora.py) on the tiny model: the engine's merged weights are
PEFT's merge_and_unload() model bit for bit (greedy tokens equal, dense and compressed,
and the SGLang backend's weight buckets carry them), the reference pass with the adapters
off is the base, the saved adapter loads with PeftModel.from_pretrained, and bad
model.lora settings stop with one line naming the key."""
import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisparse.config.load import load_config
from minisparse.config.schema import CompressConfig, ConfigError, EngineConfig, LoraConfig
from minisparse.engine import LLMEngine
from minisparse.engine.config import SamplingParams
from minisparse.models.loading import load_policy
from minisparse.models.lora import (MergedWeights, adapters_disabled, apply_lora, lora_enabled,
                                    save_adapter, save_merged, trainable_parameters)

REPO = Path(__file__).resolve().parents[2]
SETTINGS = LoraConfig(enabled=True, rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def models(tiny_path):
    """(base, LoRA policy whose adapters moved away from their zero start, tokenizer)."""
    base, tokenizer = load_policy(str(tiny_path), "float32")
    policy = apply_lora(copy.deepcopy(base), SETTINGS, seed=1)
    with torch.no_grad():  # as training would: lora_B leaves 0, lora_A moves
        g = torch.Generator().manual_seed(0)
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return base.eval(), policy.eval(), tokenizer


@pytest.fixture(scope="module")
def peft_merged(models, tmp_path_factory):
    """PEFT's own merged model: the saved adapter loaded onto the base, merge_and_unload()."""
    from peft import PeftModel

    base, policy, _ = models
    folder = tmp_path_factory.mktemp("adapter")
    save_adapter(policy, folder)
    return PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload().eval()


def test_only_adapters_train(models):
    base, policy, _ = models
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    # 2 layers x 7 linears, rank 4 x (in + out): q 64+64, k 64+32, v 64+32, o 64+64,
    # gate 64+128, up 64+128, down 128+64
    assert trainable_parameters(policy) == 2 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert lora_enabled(policy) and not lora_enabled(base)


def test_merged_weights_equal_peft_merge_and_unload(models, peft_merged):
    base, policy, _ = models
    view = MergedWeights(policy).refresh()
    assert type(view) is type(base)
    ours, theirs = view.state_dict(), peft_merged.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not torch.equal(ours["model.layers.0.mlp.down_proj.weight"],
                           base.state_dict()["model.layers.0.mlp.down_proj.weight"])
    # shared, not copied: the embedding (tied head) and norms are the policy's tensors
    assert view.lm_head.weight is view.model.embed_tokens.weight
    assert view.model.embed_tokens.weight is policy.model.embed_tokens.weight


def test_refresh_follows_the_adapters_and_release_frees_the_copies(models):
    _, policy, _ = models
    merged = MergedWeights(policy)
    first = merged.refresh().model.layers[1].self_attn.v_proj.weight.clone()
    layer = policy.model.layers[1].self_attn.v_proj
    assert merged.merged_bytes == sum(m.get_base_layer().weight.numel() * 4
                                      for m in merged.layers.values())
    saved = layer.lora_B["default"].weight.detach().clone()
    with torch.no_grad():
        layer.lora_B["default"].weight.add_(0.1)
        try:
            second = merged.refresh().model.layers[1].self_attn.v_proj.weight.clone()
        finally:
            layer.lora_B["default"].weight.copy_(saved)
    assert not torch.equal(first, second)
    merged.release()
    assert merged.merged_bytes == 0
    assert merged.model.model.layers[1].self_attn.v_proj.weight is layer.get_base_layer().weight


@pytest.mark.parametrize("compress", ["none", "rkv"])
def test_engine_greedy_tokens_on_merged_weights_equal_peft(models, peft_merged, compress):
    """The native engine over MergedWeights samples what it samples over PEFT's merged
    model: the same greedy tokens and log-probs, dense and with R-KV compression."""
    _, policy, tokenizer = models
    cfg = EngineConfig(kv_cpu_memory_gb=0.02, max_num_seqs=8, page_size=4, cuda_graphs=False)
    comp = CompressConfig(algorithm=compress, budget=16, window=4, divide_length=8)
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    prompts = [tokenizer.encode(t) for t in ("What is 12 + 30?", "Let us think", "x = 7")]
    outs = []
    for model in (MergedWeights(policy).refresh(), peft_merged):
        outs.append(LLMEngine(model, tokenizer, cfg, comp, "cpu").generate(prompts, params))
    ours, theirs = outs
    assert [o.token_ids for o in ours] == [o.token_ids for o in theirs]
    assert all(torch.equal(torch.as_tensor(a.logprobs), torch.as_tensor(b.logprobs))
               for a, b in zip(ours, theirs))
    if compress == "rkv":
        assert sum(o.num_compressions for o in ours) > 0


def test_sglang_weight_update_carries_the_merged_weights(models, peft_merged):
    """The SGLang backend pushes weight_buckets(model): given the merged view, its names
    and tensors are those of PEFT's merged model."""
    from minisparse.engine.sglang_backend import weight_buckets

    _, policy, _ = models
    sent = {n: t for bucket in weight_buckets(MergedWeights(policy).refresh(), torch.float32)
            for n, t in bucket}
    expected = dict(peft_merged.named_parameters())
    assert sent.keys() == expected.keys()
    assert all(torch.equal(sent[n], expected[n]) for n in sent)


def test_reference_pass_with_adapters_off_is_the_base(models):
    base, policy, _ = models
    ids = torch.tensor([[5, 17, 42, 9, 100, 3]])
    with torch.no_grad():
        adapted = policy(ids).logits
        with adapters_disabled(policy) as model:
            reference = model(ids).logits
        again = policy(ids).logits
        expected = base(ids).logits
    assert torch.equal(reference, expected)
    assert torch.equal(adapted, again) and not torch.equal(adapted, expected)
    assert all(p.requires_grad for n, p in policy.named_parameters() if ".lora_" in n)


def test_saved_merged_model_and_adapter(models, peft_merged, tmp_path):
    """hf/: a plain HF directory of the merged weights; adapter/: PEFT's files, rank,
    alpha and targets as configured."""
    import json

    from transformers import AutoModelForCausalLM

    _, policy, _ = models
    save_merged(policy, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    expected = peft_merged.state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    save_adapter(policy, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert sorted(config["target_modules"]) == sorted(SETTINGS.target_modules)


@pytest.mark.parametrize("setting, message", [
    ("model.lora.rank=0", "config key 'model.lora.rank' must be >= 1, got 0"),
    ("model.lora.target_modules=q_proj,lm_head",
     "config key 'model.lora.target_modules' must be a non-empty list of q_proj, k_proj, "
     "v_proj, o_proj, gate_proj, up_proj, down_proj; got ['q_proj', 'lm_head']"),
    ("model.lora.alpha=-1", "config key 'model.lora.alpha' must be > 0, got -1.0"),
    ("model.lora.dropout=1", "config key 'model.lora.dropout' must be in [0, 1), got 1.0"),
])
def test_bad_settings_name_the_key(setting, message):
    with pytest.raises(ConfigError) as err:
        load_config("tiny_rkv", [setting])
    assert str(err.value) == message


def test_lora_with_zero_3_is_refused():
    with pytest.raises(ConfigError, match=r"^config key 'model.lora.enabled' is true but "
                                          r"'zero_stage' is 3"):
        load_config("tiny_rkv", ["model.lora.enabled=true", "zero_stage=3"])
    assert not load_config("tiny_rkv").model.lora.enabled  # off by default


def test_train_stops_with_one_line_on_a_bad_lora_setting(tmp_path, _minisparse_cache):
    res = subprocess.run([sys.executable, "train.py", "--config", "tiny_rkv", "--set",
                          f"output_dir={tmp_path}", "--set", "model.lora.enabled=true",
                          "--set", "model.lora.rank=-2"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].endswith(
        "config key 'model.lora.rank' must be >= 1, got -2")
