"""A tiny random Qwen2 model and a locally trained tokenizer, saved as an HF directory.

Tests and the tiny_* configs need a real HF checkpoint (from_pretrained, chat template,
eos/pad ids) without any hub access, and need it to be the same every time so that
seeded runs are reproducible. Building takes about a second; the result is cached.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

TINY_VERSION = "tiny-v1"  # bump when the model or tokenizer recipe changes

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
BPE_VOCAB_SIZE = 512
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's template, minus tool calls and the default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TINY_MODEL = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=4096,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


def _corpus() -> list[str]:
    """Deterministic training text: the characters and fragments math rollouts contain."""
    words = (
        "What is the answer ? Let us think step by step . First , compute the sum and "
        "the product . Therefore the final answer is Please reason put your final answer "
        "within boxed Solution : We have so x y z n = + - * / ^ ( ) [ ] { } < > | ! ' \" "
        "# $ % & @ ~ ` ; : _ a b c d e f g h i j k l m n o p q r s t u v w x y z "
        "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z"
    ).split()
    latex = [r"\boxed{", r"\frac{", r"\dfrac{", r"\sqrt{", r"\cdot", r"\times", r"\pi",
             r"^\circ", r"\left(", r"\right)", r"\le", r"\ge", r"\infty", r"\text{",
             "$", "$$", r"\begin{pmatrix}", r"\end{pmatrix}", r"\\"]
    lines = []
    for i in range(400):
        a, b = (i * 37) % 1000, (i * 91 + 7) % 1000
        w = " ".join(words[(i + k) % len(words)] for k in range(8))
        t = " ".join(latex[(i + k) % len(latex)] for k in range(3))
        lines.append(f"{w} {a} + {b} = {a + b}.\n{t} {a}/{b}\n\n\\boxed{{{a * b}}}\n")
    return lines


def _bpe_json() -> dict:
    """A byte-level BPE (every byte is a token, so any text encodes) as tokenizer.json."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import trainers

    # The same normalizer and pre-tokenizer as transformers' Qwen2Tokenizer, which
    # AutoTokenizer rebuilds from the saved vocab: saved and in-memory tokenizers agree.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return json.loads(tok.to_str())


def build_tokenizer(vocab_size: int | None = None):
    """Qwen-style PreTrainedTokenizerFast. With vocab_size, filler tokens pad the
    vocabulary so every id a larger model can sample still decodes (shape models)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = _bpe_json()
    vocab = spec["model"]["vocab"]
    if vocab_size is not None:
        n_fill = vocab_size - len(SPECIAL_TOKENS) - len(vocab)
        if n_fill < 0:
            raise ValueError(
                f"vocab_size {vocab_size} is below the base vocabulary "
                f"({len(vocab) + len(SPECIAL_TOKENS)})"
            )
        base = len(vocab)
        vocab.update({f"<filler_{i}>": base + i for i in range(n_fill)})
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.add_special_tokens(list(SPECIAL_TOKENS))  # Qwen's order: pad, im_start, im_end
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[BOS_TOKEN],
        model_max_length=TINY_MODEL["max_position_embeddings"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _save_tiny(target: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    spec = dict(TINY_MODEL)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        rope_parameters={"rope_type": "default", "rope_theta": spec.pop("rope_theta")},
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **spec,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    _save_on_any_rank(model, target)
    tokenizer.save_pretrained(target)


def _save_on_any_rank(model, target: Path) -> None:
    """The model's files in HF's layout, written by whichever process builds them. Under
    torchrun, model.save_pretrained writes nothing on ranks other than 0 (transformers
    saves on rank 0 alone once torch.distributed is up); a rank that built the cache
    first then moved a directory without weights or config.json into place, and every
    rank after it failed to load."""
    from safetensors.torch import save_model

    model.config.save_pretrained(target)
    model.generation_config.save_pretrained(target)
    save_model(model, str(target / "model.safetensors"), metadata={"format": "pt"})


def default_cache_root() -> Path:
    return Path(os.environ.get("MINISPARSE_CACHE") or Path.home() / ".cache" / "minisparse")


def build_tiny(cache_dir: str | Path | None = None) -> Path:
    """Path of the cached tiny model directory, building it on first use.

    cache_dir replaces the cache root ($MINISPARSE_CACHE, else ~/.cache/minisparse).
    The build goes to a temp dir that is renamed into place, so concurrent processes
    (one per rank) never see a half-written checkpoint.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / TINY_VERSION
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_VERSION}-", dir=root))
    try:
        _save_tiny(tmp)
        _move_into_place(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _move_into_place(built: Path, target: Path) -> None:
    """Rename a finished build to target. A target without config.json is an older,
    interrupted build (it blocks the rename forever): it is moved aside and replaced."""
    for _ in range(2):
        try:
            os.rename(built, target)
            return
        except OSError:
            if (target / "config.json").is_file():  # another process won the race
                return
            if not target.exists():
                raise
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}-stale-", dir=target.parent))
            try:
                os.rename(target, stale / target.name)
            except FileNotFoundError:  # someone else moved it first
                pass
            shutil.rmtree(stale, ignore_errors=True)
    os.rename(built, target)
