"""Dense log-probs of response tokens, for packed prompt+response sequences.

One forward over a single row holding several sequences back to back, with
position_ids restarting at 0 for each. Under our packed attentions (attention.py) the
sequences' boundaries go to a variable-length kernel; under "sdpa" transformers builds a
block-diagonal causal mask. Either way no padding is computed and the result equals
per-sequence forwards (tests/trainer/test_logprobs.py checks it). Only the response
positions go through the LM head, fused with the float32 log-softmax in chunks
(fused_logprobs.py) unless `chunk` is 0.
"""

from __future__ import annotations

import torch
from torch import nn

from minisparse.models.attention import PACKED, packing_kwargs
from minisparse.trainer.batching import pack_by_tokens
from minisparse.models.fused_logprobs import entropy_from, fused_logprobs
from minisparse.utils.transfer import to_device


def pack_sequences(
    seqs: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [1, L], position_ids [1, L]) for sequences concatenated in order."""
    ids = to_device([t for s in seqs for t in s], device)
    pos = torch.cat([torch.arange(len(s), device=device) for s in seqs])  # no copy
    return ids[None], pos[None]


def _response_positions(
    prompt_lens: list[int], response_lens: list[int]
) -> tuple[list[int], list[int]]:
    """(positions whose logits predict response tokens, positions of those tokens)."""
    pred, target, start = [], [], 0
    for p, r in zip(prompt_lens, response_lens):
        target.extend(range(start + p, start + p + r))
        pred.extend(range(start + p - 1, start + p + r - 1))
        start += p + r
    return pred, target


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[target] and the distribution's entropy, in float32."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    return logp, entropy_from(logits, lse) if with_entropy else None


@torch.no_grad()
def entropy_metric(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Entropy per row without gradients, a chunk of rows at a time: a float32 softmax
    over a 150k vocabulary for every token of a micro-batch would cost gigabytes."""
    parts = []
    for rows in torch.split(logits.detach(), chunk):
        rows = rows.float()
        parts.append(entropy_from(rows, torch.logsumexp(rows, dim=-1)))
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def pad_rows(flat: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """Split a flat per-token tensor by lengths into a zero-padded [len(lengths), width]."""
    out = flat.new_zeros(len(lengths), width)
    for i, row in enumerate(torch.split(flat, lengths)):
        out[i, : row.numel()] = row
    return out


def _packed_hidden(
    model: nn.Module, seqs: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden states [L, H], input ids [L]) of the sequences packed into one row."""
    device = next(model.parameters()).device
    input_ids, position_ids = pack_sequences(seqs, device)
    extra = {}
    if model.config._attn_implementation in PACKED:
        extra = packing_kwargs([len(s) for s in seqs], device)
    hidden = model.model(
        input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra
    ).last_hidden_state
    return hidden[0], input_ids[0]


def _can_fuse(lm_head: nn.Module) -> bool:
    """The fused path reads the weight directly: not with a bias, nor under ZeRO 3
    (a partitioned weight is gathered only by lm_head's own forward hooks)."""
    return getattr(lm_head, "bias", None) is None and not hasattr(lm_head.weight, "ds_id")


def response_logprobs(
    model: nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    width: int,
    entropy: str = "none",
    temperature: float = 1.0,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [n, width], entropy [n, width] or None) of each response token under
    model given its prompt; rows zero-padded past the response length.

    entropy: "none" | "detached" (a metric only) | "grad" (entropy bonus in the loss).
    The model is an HF causal LM (or a DeepSpeed engine's .module); gradients flow when
    autograd is on. Logits are divided by the sampling temperature, as the engine does,
    so dense and sampler log-probs describe the same distribution. chunk > 0 fuses the
    LM head with the log-softmax over that many tokens at a time (fused_logprobs.py).
    """
    hidden, input_ids = _packed_hidden(model, [p + r for p, r in zip(prompts, responses)])
    pred, target = (to_device(x, hidden.device) for x in
                    _response_positions([len(p) for p in prompts], [len(r) for r in responses]))
    if temperature in (0.0, 1.0):  # the engine's greedy log-probs are taken at T=1
        temperature = 1.0
    if chunk > 0 and _can_fuse(model.lm_head):
        logp, ent = fused_logprobs(
            hidden[pred], model.lm_head.weight, input_ids[target], temperature, chunk,
            with_entropy=entropy != "none",
        )
        if entropy == "detached":
            ent = ent.detach()
    else:
        logits = model.lm_head(hidden[pred])
        if temperature != 1.0:
            logits = logits / temperature
        logp, ent = token_logprobs(logits, input_ids[target], entropy == "grad")
        if entropy == "detached":
            ent = entropy_metric(logits)
    lengths = [len(r) for r in responses]
    return pad_rows(logp, lengths, width), None if ent is None else pad_rows(ent, lengths, width)


@torch.no_grad()
def batch_logprobs(
    model: nn.Module,
    prompts: list[list[int]],
    responses: list[list[int]],
    width: int,
    max_tokens: int,
    temperature: float = 1.0,
    chunk: int = 0,
) -> torch.Tensor:
    """[N, width] log-probs (CPU, float32) for a whole batch, in packed micro-batches of
    at most max_tokens tokens; no gradients (old and reference log-probs)."""
    device = next(model.parameters()).device
    out = torch.zeros(len(responses), width, device=device)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    for group in pack_by_tokens(lengths, max_tokens):
        logp, _ = response_logprobs(
            model,
            [prompts[i] for i in group],
            [responses[i] for i in group],
            width,
            temperature=temperature,
            chunk=chunk,
        )
        out[to_device(group, device)] = logp.float()  # a list index would wait for the GPU
    return out.cpu()  # one copy at the end: the host prepares micro-batches ahead
