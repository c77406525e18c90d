"""LoRA adapters through PEFT (model.lora): only the adapters train, the base stays as
loaded, and the rollout engine samples with the merged weights.

* apply_lora injects PEFT's LoRA layers into the HF policy in place (inject_adapter_in_model):
  the policy keeps its class, so every training pass (.model.layers, .lm_head, packed
  attention, gradient checkpointing) works unchanged; only lora_A/lora_B require grads,
  so DeepSpeed holds optimizer state for them alone.
* The reference policy is the frozen base itself: adapters_disabled() turns the adapters
  off for the reference log-prob pass (no copy of the weights, as TRL does with PEFT).
* MergedWeights is what the rollout engine (native, dense or compressed, or SGLang) is
  given: a plain HF model of the same class whose tensors are the policy's own, except
  each adapted linear weight, which is W + scale * B A computed as PEFT's merge computes
  it (refresh(), each rollout); release() hands that copy's memory back for training.
* A checkpoint holds the merged model in hf/ (what eval.py and from_pretrained read) and
  the adapters in adapter/ in PEFT's format (PeftModel.from_pretrained(base, adapter/)).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from minisparse.config.schema import LoraConfig

ADAPTER = "default"  # PEFT's adapter name
ADAPTER_DIR = "adapter"  # a checkpoint's folder of PEFT adapter files


def peft_config(settings: LoraConfig, base_path: str | None = None):
    """PEFT's LoraConfig for model.lora (bias-free adapters on the named linear layers)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                          lora_dropout=settings.dropout,
                          target_modules=list(settings.target_modules), bias="none",
                          base_model_name_or_path=base_path)


def apply_lora(model: nn.Module, settings: LoraConfig, seed: int = 0,
               base_path: str | None = None) -> nn.Module:
    """Inject LoRA layers into `model` in place and freeze everything else; returns it.
    The adapters' random init (lora_A; lora_B starts at zero, so the policy starts as the
    base) comes from a generator seeded with `seed` on every rank, leaving the run's own
    random stream as it was."""
    from peft import inject_adapter_in_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(settings, base_path), model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model.lora.target_modules {settings.target_modules} matched no "
                         f"layer of the model")
    return model


def lora_enabled(model: nn.Module) -> bool:
    """Whether apply_lora injected adapters into `model`."""
    return getattr(model, "peft_config", None) is not None


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> PEFT LoRA layer (its base linear is .base_layer)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The base model inside the block (PEFT's disable_adapter, on the layers themselves):
    the reference policy's log-probs, without a copy of the weights."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merged_weight(layer: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
    """W + scale * B A of one LoRA layer, rounded as PEFT's merge (and merge_and_unload)
    rounds it: the delta in the adapters' dtype, added in place to a copy of W."""
    base = layer.get_base_layer().weight.detach()
    out = base.clone() if out is None else out.copy_(base)
    out += layer.get_delta_weight(ADAPTER)
    return out


def _hf_name(name: str) -> str:
    """The plain HF name of a LoRA-injected model's tensor (q_proj.base_layer.weight ->
    q_proj.weight)."""
    return name.replace(".base_layer.", ".")


def _set_tensor(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = root.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = tensor
    else:
        module._buffers[attr] = tensor


class MergedWeights:
    """The LoRA policy as a plain HF model of its own class for the rollout engine: every
    tensor is the policy's own (no copy) but the adapted weights, which refresh() merges
    into a copy and release() frees (they then read the base weights again)."""

    def __init__(self, model: nn.Module) -> None:
        self.policy = model
        self.layers = lora_layers(model)
        with torch.device("meta"):
            view = type(model)(model.config)
        view.generation_config = model.generation_config
        named = [*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)]
        for name, tensor in named:
            if ".lora_" not in name:
                _set_tensor(view, _hf_name(name), tensor)
        left = [n for n, t in [*view.named_parameters(), *view.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"merged view: no tensor of the policy for {left[:3]}")
        self.model = view.eval().requires_grad_(False)
        self.merged: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def refresh(self) -> nn.Module:
        """The view with W + scale * B A of the adapters as they are now (copies made on
        the first call after a release, then updated in place)."""
        for name, layer in self.layers.items():
            self.merged[name] = merged_weight(layer, self.merged.get(name))
            self.model.get_submodule(name)._parameters["weight"] = nn.Parameter(
                self.merged[name], requires_grad=False)
        return self.model

    def release(self) -> None:
        """Free the merged copies: the adapted weights of the view read the base again."""
        for name, layer in self.layers.items():
            self.model.get_submodule(name)._parameters["weight"] = layer.get_base_layer().weight
        self.merged = {}

    @property
    def merged_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.merged.values())


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights under plain HF names on the CPU, the adapted ones merged (one
    layer's copy at a time on the weights' device); tied weights once."""
    layers = lora_layers(model)
    out = {}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        owner = name.removesuffix(".base_layer.weight")
        tensor = merged_weight(layers[owner]) if owner in layers and owner != name else param
        out[_hf_name(name)] = tensor.detach().to("cpu", copy=True).contiguous()
    return out


def save_merged(model: nn.Module, folder: Path) -> None:
    """The merged policy as an HF directory (config.json, model.safetensors): what
    from_pretrained and eval.py load, no PEFT needed."""
    MergedWeights(model).model.save_pretrained(folder, state_dict=merged_state_dict(model))


def save_adapter(model: nn.Module, folder: Path) -> None:
    """The adapters in PEFT's format (adapter_config.json, adapter_model.safetensors):
    PeftModel.from_pretrained(base model, folder) loads them."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = model.peft_config[ADAPTER]
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False)
    # keys as a PeftModel saves them: under its base_model.model. prefix
    save_file({f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in state.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    inference = config.inference_mode
    config.inference_mode = True  # as PeftModel.save_pretrained writes it
    try:
        config.save_pretrained(str(folder))
    finally:
        config.inference_mode = inference
