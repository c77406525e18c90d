import json

import pytest
import torch
from spawned_ranks import spawned_rank

from minisparse.models.loading import SHAPES, build_shape_model, load_policy, shape_config
from minisparse.models.tiny import build_tiny, build_tokenizer


def test_tiny_loads_offline_with_qwen_specials(tiny_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_path, local_files_only=True)
    assert model.config.model_type == "qwen2"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    assert model.config.vocab_size == len(tok)
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tiny_chat_template_and_roundtrip(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
        add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    sample = "So $x = \\dfrac{3}{4}$,\n\n\\boxed{90^\\circ} 12.5% ünï 你好"
    ids = tok(sample)["input_ids"]
    assert tok.decode(ids) == sample
    # The saved tokenizer and the in-memory one split text identically.
    assert build_tokenizer()(sample)["input_ids"] == ids


def test_build_tiny_replaces_an_interrupted_build(tmp_path):
    # What an older, non-atomic build left behind when it was killed: tokenizer, no model.
    stale = tmp_path / build_tiny(tmp_path / "fresh").name
    stale.mkdir()
    (stale / "tokenizer.json").write_text("{}")
    built = build_tiny(tmp_path)
    assert built == stale and (built / "config.json").is_file()
    assert json.loads((built / "tokenizer.json").read_text())["model"]["vocab"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["fresh", built.name])


def test_build_tiny_is_cached_and_deterministic(tiny_path, tmp_path):
    assert build_tiny() == tiny_path
    stamp = (tiny_path / "config.json").stat().st_mtime_ns
    assert build_tiny() == tiny_path and (tiny_path / "config.json").stat().st_mtime_ns == stamp
    other = build_tiny(tmp_path)
    assert other == tmp_path / tiny_path.name and other != tiny_path
    assert list(tmp_path.iterdir()) == [other]  # the temp build dir was renamed away
    from safetensors.torch import load_file

    a, b = load_file(tiny_path / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    vocab = lambda p: json.loads((p / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocab(tiny_path) == vocab(other)


def test_padded_tokenizer_decodes_every_id():
    tok = build_tokenizer(vocab_size=2000)
    assert len(tok) == 2000
    assert tok.convert_ids_to_tokens(1999) == "<|im_end|>" == tok.eos_token
    assert tok.decode([1500]).startswith("<filler_")
    with pytest.raises(ValueError, match="below the base vocabulary"):
        build_tokenizer(vocab_size=100)


def test_load_policy_tiny_generates(tiny_path):
    model, tok = load_policy("tiny", dtype="float32")
    ids = tok("What is 1 + 1?", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    assert model.dtype == torch.float32


@pytest.mark.parametrize("name,expected", [
    ("qwen2.5-1.5b", (1536, 28, 12, 2, 8960, True)),
    ("qwen2.5-3b", (2048, 36, 16, 2, 11008, True)),
    ("qwen2.5-7b", (3584, 28, 28, 4, 18944, False)),
    ("llama-3.2-1b", (2048, 16, 32, 8, 8192, True)),
])
def test_shape_configs(name, expected):
    c = shape_config(name)
    got = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
           c.num_key_value_heads, c.intermediate_size, c.tie_word_embeddings)
    assert got == expected
    assert c.vocab_size == (128256 if name.startswith("llama") else 151936)


def test_shape_model_on_meta_has_true_parameter_count():
    model = build_shape_model("qwen2.5-3b", device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert 3.0e9 < n < 3.2e9  # Qwen2.5-3B: 3.09B with tied embeddings
    assert next(model.parameters()).dtype == torch.bfloat16
    assert shape_config("llama-3.2-1b").rope_parameters["rope_type"] == "llama3"


def test_shape_model_materialises_with_sane_init(monkeypatch):
    small = dict(SHAPES["qwen2.5-1.5b"][1], num_hidden_layers=1, vocab_size=1000)
    monkeypatch.setitem(SHAPES, "qwen-small", ("qwen2", small))
    model, tok = load_policy("qwen-small", dtype="float32")
    assert len(tok) == 1000
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.bias is not None and (layer.self_attn.q_proj.bias == 0).all()
    assert (layer.input_layernorm.weight == 1).all()
    assert abs(layer.mlp.up_proj.weight.std().item() - 0.02) < 1e-3
    rotary = model.model.rotary_emb
    head_dim = 1536 // 12
    expected = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    assert torch.allclose(rotary.inv_freq, expected)


def test_shape_model_weights_do_not_follow_the_global_seed(monkeypatch):
    """train.py seeds torch by rank; the random weights must still be the same on every
    rank, or the reference model (copied before DeepSpeed broadcasts rank 0's policy)
    differs from the policy on the other ranks."""
    small = dict(SHAPES["qwen2.5-1.5b"][1], num_hidden_layers=1, vocab_size=1000)
    monkeypatch.setitem(SHAPES, "qwen-small", ("qwen2", small))
    models = []
    for rank in (0, 1):
        torch.manual_seed(42 + rank)
        models.append(load_policy("qwen-small", dtype="float32")[0])
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), name


def test_load_policy_missing_dir_names_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_policy(str(tmp_path / "nope"))


def _build_on_rank(rank: int, init_file: str, root: str) -> None:
    """Each of two gloo ranks builds the tiny model into a cache of its own."""
    with spawned_rank(rank, 2, init_file):
        build_tiny(f"{root}/rank{rank}")


def test_build_tiny_under_torchrun_on_any_rank(tiny_path, tmp_path):
    """transformers saves a model on rank 0 alone once torch.distributed is up: a cache
    built by another rank (`torchrun --nproc_per_node 2 train.py --config tiny_rkv` on a
    fresh machine, whichever rank renames its build into place first) lacked weights and
    config.json, and every rank failed to load it."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    mp.spawn(_build_on_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    want = load_file(tiny_path / "model.safetensors")
    for rank in (0, 1):
        built = tmp_path / f"rank{rank}" / tiny_path.name
        assert sorted(p.name for p in built.iterdir()) == sorted(p.name for p in tiny_path.iterdir())
        got = load_file(built / "model.safetensors")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        config = json.loads((built / "config.json").read_text())
        assert config["model_type"] == "qwen2" and config["tie_word_embeddings"]
