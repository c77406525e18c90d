"""A tiny random Qwen2 whose tokens are single characters, for the learning test.

With printable ASCII as its whole vocabulary (99 tokens with the specials), the untrained
model writes any one character about once in a hundred tokens, so a reward paid for one
target token has something to reinforce from the first rollout; the tiny model's 515
tokens would need five times the samples. The tokenizer is the tiny model's (same
pre-tokenizer, specials and chat template) with a byte-level BPE of no merges.
"""
from __future__ import annotations

import string
from pathlib import Path

CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # 95 printable and \n


def build_char_model(target: Path, seed: int = 0) -> Path:
    """Save the model and tokenizer as an HF directory at target."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from minisparse.models.tiny import (BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN,
                                        QWEN_PRETOKENIZE_REGEX, SPECIAL_TOKENS, TINY_MODEL)

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {byte_level.pre_tokenize_str(c)[0][0]: i for i, c in enumerate(CHARS)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated"), byte_level])
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD_TOKEN,
                                        eos_token=EOS_TOKEN, additional_special_tokens=[BOS_TOKEN],
                                        model_max_length=TINY_MODEL["max_position_embeddings"])
    tokenizer.chat_template = CHAT_TEMPLATE
    spec = {k: v for k, v in TINY_MODEL.items() if k != "rope_theta"}
    config = Qwen2Config(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
