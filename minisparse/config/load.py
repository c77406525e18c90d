"""Loading a Config: a YAML file (on top of the config it names as `base:`, if any), then
KEY=VALUE overrides, then validation (types, choices, ranges and cross-key rules), so a bad
key fails before any model is touched."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from minisparse.config.schema import (LORA_TARGETS, Config, ConfigError, Operator, Rule,
                                       choices)

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key, sections included, for 'did you mean' suggestions."""
    keys = []
    for name, hint in _hints(cls).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(hint):
            keys.extend(_all_keys(hint, prefix + name + "."))
    return keys


def _leaf_hints(cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf key -> its annotation, Annotated range rules kept."""
    out = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        if dataclasses.is_dataclass(hint):
            out.update(_leaf_hints(hint, prefix + name + "."))
        else:
            out[prefix + name] = _split_optional(hint)[0]
    return out


def choice_keys() -> dict[str, tuple[str, ...]]:
    """Dotted key -> allowed values, for every key typed with a Literal."""
    return {k: typing.get_args(h) for k, h in _leaf_hints().items() if _is_choice(h)}


def section_keys(section: str) -> list[str]:
    """The dotted leaf keys of one section in the schema's order (every compress.* key)."""
    return [key for key in _leaf_hints() if key.startswith(section + ".")]


def leaf_type(key: str) -> Any:
    """A leaf key's value type: int, float, bool, str, list[str] or a Literal (None and
    range rules stripped)."""
    return _split_optional(_leaf_hint(key))[0]


def key_default(key: str) -> Any:
    """A leaf key's default, read from its dataclass field."""
    *sections, name = key.split(".")
    cls: Any = Config
    for section in sections:
        cls = _hints(cls)[section]
    spec = next(f for f in dataclasses.fields(cls) if f.name == name)
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


def range_rules() -> dict[str, Rule]:
    """Dotted key -> Rule, for every key whose type carries one (a number's range,
    compress.algorithm's form)."""
    rules = {}
    for key, hint in _leaf_hints().items():
        for meta in getattr(hint, "__metadata__", ()):
            if isinstance(meta, Rule):
                rules[key] = meta
    return rules


def _unknown(key: str) -> ConfigError:
    close = _same_name_elsewhere(key) or difflib.get_close_matches(key, _all_keys(), n=1,
                                                                   cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(k) for k in close)}?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _same_name_elsewhere(key: str) -> list[str]:
    """Keys whose last part is the unknown key's last part, in another section: a key
    given without its section (`lr` for `optim.lr`) is spelt right but placed wrong, and
    difflib, comparing whole dotted keys, misses it."""
    name = key.rsplit(".", 1)[-1]
    return [k for k in _all_keys() if k != key and k.rsplit(".", 1)[-1] == name]


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """(inner type, None allowed) for `X | None`."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def _is_choice(hint: Any) -> bool:
    return typing.get_origin(hint) is typing.Literal


def _type_name(hint: Any) -> str:
    inner, optional = _split_optional(hint)
    name = (f"one of {', '.join(map(str, typing.get_args(inner)))}" if _is_choice(inner)
            else getattr(inner, "__name__", str(inner)))
    if typing.get_origin(inner) is list:
        name = "list of " + typing.get_args(inner)[0].__name__
    return name + (" or null" if optional else "")


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check one leaf value against its annotation; ints are fine where floats are."""
    inner, optional = _split_optional(hint)
    if value is None and optional:
        return None
    if typing.get_origin(inner) is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
    elif inner is bool:
        if isinstance(value, bool):
            return value
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif inner is float:
        if isinstance(value, str):  # PyYAML reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"config key '{key}' expects a finite number, got {value}")
            return float(value)
    elif inner is str or _is_choice(inner):  # choices are checked by validate_config
        if isinstance(value, str):
            return _numbered(value, inner)
        if isinstance(value, int) and not isinstance(value, bool) \
                and value in typing.get_args(inner):
            return value  # a number among the choices (zero_stage: 1)
        if isinstance(value, bool) and str(value).lower() in typing.get_args(inner):
            return str(value).lower()  # YAML's true / false for an auto | true | false key
    raise ConfigError(
        f"config key '{key}' expects {_type_name(hint)}, got {value!r} ({type(value).__name__})"
    )


def _numbered(text: str, hint: Any) -> Any:
    """"1" -> 1 where the choices hold the number 1 (`--set zero_stage=1`)."""
    numbers = _is_choice(hint) and any(isinstance(a, int) for a in typing.get_args(hint))
    return int(text) if numbers and text.isdigit() else text


def _build(cls: type, raw: Any, prefix: str = "") -> Any:
    """Dataclass from a nested mapping; missing keys keep their defaults."""
    if not isinstance(raw, dict):
        where = f"section '{prefix[:-1]}'" if prefix else "the config file"
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for name, value in raw.items():
        key = prefix + str(name)
        if name not in hints:
            raise _unknown(key)
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, {} if value is None else value, key + ".")
        else:
            kwargs[name] = _coerce(key, value, hint)
    return cls(**kwargs)


def _leaf_hint(key: str) -> Any:
    """Annotation of a dotted leaf key; ConfigError for unknown keys and bare sections."""
    cls: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = _hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            raise _unknown(key)
        cls = hints[part]
        if dataclasses.is_dataclass(cls) and i == len(parts) - 1:
            raise ConfigError(f"config key '{key}' is a section; set its keys ('{key}.x=...')")
    return cls


def _parse_override(item: str) -> tuple[str, Any]:
    """`a.b=value` -> (key, value); str-typed keys keep the raw text ('yes' stays 'yes')."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like KEY=VALUE")
    key, text = (s.strip() for s in item.split("=", 1))
    hint = _leaf_hint(key)
    inner, optional = _split_optional(hint)
    if _is_choice(inner) and text.lower() in ("true", "false") \
            and "true" in typing.get_args(inner):
        return key, text.lower()  # True -> true for an auto | true | false key
    if (inner is str or _is_choice(inner)) and not (optional and text in ("null", "None", "~")):
        return key, text
    try:
        return key, yaml.safe_load(text) if text else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"config key '{key}': cannot parse value {text!r}: {exc}") from None


def _apply_overrides(raw: dict, overrides: Sequence[str]) -> None:
    for item in overrides:
        key, value = _parse_override(item)
        *sections, leaf = key.split(".")
        node = raw
        for section in sections:
            child = node.get(section)
            if not isinstance(child, dict):
                child = node[section] = {}
            node = child
        node[leaf] = value


def resolve_config_path(name: str) -> Path:
    """An existing path as is, else configs/NAME[.yaml] relative to the repo root."""
    path = Path(name)
    if path.is_file():
        return path
    candidate = CONFIGS_DIR / (name if name.endswith((".yaml", ".yml")) else name + ".yaml")
    if candidate.is_file():
        return candidate
    raise ConfigError(
        f"config '{name}' not found (neither a file nor {candidate}); "
        f"available configs: {', '.join(shipped_configs()) or '(none)'}"
    )


def shipped_configs() -> list[str]:
    """The names `--config` takes from configs/, sorted."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))


BASE_KEY = "base"


def _read_yaml(path: Path) -> dict:
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    if raw is None or raw == {}:  # an empty file would train every default, unasked
        d = Config()
        raise ConfigError(
            f"config {path} sets nothing: it would run every default ({d.num_rollout} "
            f"rollouts of {d.rollout_batch_size} prompts x {d.n_samples_per_prompt} samples "
            f"of up to {d.max_response_len} tokens); set the keys you mean, or start from a "
            f"shipped config with a line such as 'base: tiny_rkv'")
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    return raw


def _merge(base: dict, over: dict) -> dict:
    """base with over's keys on top, section by section: a config that names a base sets
    only the keys it changes, and a section it leaves empty keeps the base's."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(out.get(key), dict) and (value is None or isinstance(value, dict)):
            out[key] = _merge(out[key], value or {})
        else:
            out[key] = value
    return out


def _base_path(name: Any, child: Path) -> Path:
    """The file a config's `base:` names: NAME[.yaml] beside the config first (a folder of
    one's own configs), else an existing path or a shipped config, as --config takes."""
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"config {child}: '{BASE_KEY}' must name a config, got {name!r}")
    sibling = child.parent / (name if name.endswith((".yaml", ".yml")) else name + ".yaml")
    if sibling.is_file():
        return sibling
    try:
        return resolve_config_path(name)
    except ConfigError:
        raise ConfigError(f"config {child}: its base '{name}' is neither a file nor a config "
                          f"beside it; available configs: {', '.join(shipped_configs())}"
                          ) from None


def read_config_file(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    """The raw settings of a config file with its bases merged under it, `base:` itself
    dropped; a base that leads back to a config on the chain is an error."""
    raw = _read_yaml(path)
    if BASE_KEY not in raw:
        return raw
    chain = chain + (path.resolve(),)
    base = _base_path(raw.pop(BASE_KEY), path)
    if base.resolve() in chain:
        names = " -> ".join(p.stem for p in chain + (base,))
        raise ConfigError(f"config {path}: its bases form a cycle ({names})")
    return _merge(read_config_file(base, chain), raw)


def load_config(name_or_path: str | None = None, overrides: Sequence[str] = ()) -> Config:
    """YAML file over its bases (or defaults for None), then KEY=VALUE overrides, then
    validation."""
    raw = {} if name_or_path is None else read_config_file(resolve_config_path(name_or_path))
    _apply_overrides(raw, overrides)
    cfg = _build(Config, raw)
    _expand_home(cfg)
    validate_config(cfg)
    return cfg


# Keys that name a file or folder: a leading ~ is the user's home, as in a shell.
PATH_KEYS = ("model.path", "data.path", "output_dir", "eval.data_dir")


def _expand_home(cfg: Config) -> None:
    """~ and ~user at the start of the PATH_KEYS' values, expanded in place: YAML and
    --set pass them on as written, and no file is named ~."""
    for key in PATH_KEYS:
        *sections, leaf = key.split(".")
        node: Any = cfg
        for section in sections:
            node = getattr(node, section)
        value = getattr(node, leaf)
        if isinstance(value, str) and value.startswith("~"):
            setattr(node, leaf, os.path.expanduser(value))


def dotted_items(tree: dict, prefix: str = "") -> dict[str, Any]:
    """A nested settings dict as its dotted keys (`compress.budget`), the way --set names
    them, to compare two configs key by key."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(dotted_items(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_value(cfg: Config, key: str) -> Any:
    """The value of a dotted leaf key in cfg."""
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _check_ranges(cfg: Config) -> None:
    for key, rule in range_rules().items():
        value = config_value(cfg, key)
        if value is not None and not rule.ok(value):
            raise ConfigError(f"config key '{key}' must be {rule.text}, got {value!r}")


def _check_bounds(lower_key: str, upper_key: str, lower: float, upper: float) -> None:
    if lower > upper:
        raise ConfigError(
            f"config key '{lower_key}' ({lower}) must be <= '{upper_key}' ({upper})"
        )


def _check_operators(operators: list[str]) -> None:
    allowed = choices(Operator)
    if not operators or any(op not in allowed for op in operators):
        raise ConfigError(f"config key 'data.synthetic_operators' must be a non-empty list of "
                          f"{', '.join(allowed)}; got {operators!r}")


def _check_lora(cfg: Config) -> None:
    lora = cfg.model.lora
    unknown = [m for m in lora.target_modules if m not in LORA_TARGETS]
    if not lora.target_modules or unknown:
        raise ConfigError(f"config key 'model.lora.target_modules' must be a non-empty list of "
                          f"{', '.join(LORA_TARGETS)}; got {lora.target_modules!r}")
    if lora.enabled and cfg.zero_stage == 3:
        raise ConfigError("config key 'model.lora.enabled' is true but 'zero_stage' is 3: "
                          "LoRA trains with the base weights whole on each GPU; set "
                          "zero_stage=auto (1 or 2: only the adapters' state is sharded)")


def _check_relations(cfg: Config) -> None:
    c, loss = cfg.compress, cfg.loss
    _check_operators(cfg.data.synthetic_operators)
    _check_lora(cfg)
    if cfg.engine.backend == "sglang" and c.algorithm != "none":
        raise ConfigError(
            f"config key 'engine.backend' is sglang but 'compress.algorithm' is "
            f"{c.algorithm!r}: SGLang cannot free evicted tokens from its KV cache, so "
            f"compressed rollouts need engine.backend=native (sglang is dense only)"
        )
    if c.algorithm != "none" and c.budget <= c.window:
        raise ConfigError(
            f"config key 'compress.budget' ({c.budget}) must be > 'compress.window' "
            f"({c.window}) when compression is on"
        )
    if c.max_buffer is not None and c.max_buffer < c.divide_length:
        raise ConfigError(
            f"config key 'compress.max_buffer' ({c.max_buffer}) must be >= "
            f"'compress.divide_length' ({c.divide_length})"
        )
    if cfg.reward.overlong_buffer > cfg.max_response_len:
        raise ConfigError(
            f"config key 'reward.overlong_buffer' ({cfg.reward.overlong_buffer}) must be <= "
            f"'max_response_len' ({cfg.max_response_len}): the penalty starts that many "
            f"tokens before the response limit"
        )
    _check_bounds("loss.tis_lower", "loss.tis_upper", loss.tis_lower, loss.tis_upper)
    _check_bounds("loss.rs_lower", "loss.rs_upper", *loss.rs_bounds())
    _check_bounds("optim.min_lr", "optim.lr", cfg.optim.min_lr, cfg.optim.lr)
    rollout = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    update = cfg.global_batch_size * cfg.num_steps_per_rollout
    if rollout != update:
        raise ConfigError(
            f"rollout_batch_size * n_samples_per_prompt ({cfg.rollout_batch_size} * "
            f"{cfg.n_samples_per_prompt} = {rollout}) must equal global_batch_size * "
            f"num_steps_per_rollout ({cfg.global_batch_size} * {cfg.num_steps_per_rollout} "
            f"= {update})"
        )


def validate_config(cfg: Config) -> None:
    """Enums, ranges and cross-key rules; cheap, so train.py fails before loading a model."""
    for key, allowed in choice_keys().items():
        value = config_value(cfg, key)
        if value is None and _split_optional(_leaf_hint(key))[1]:
            continue  # an optional choice left unset (e.g. loss.rs_level: as tis_level)
        if value not in allowed:
            raise ConfigError(
                f"config key '{key}' must be one of {', '.join(map(str, allowed))}; "
                f"got {value!r}"
            )
    _check_ranges(cfg)
    _check_relations(cfg)


def check_training_config(cfg: Config) -> None:
    """Rules for training alone (train.py passes it to config_from_args): eval.py loads
    the same configs through validate_config, and greedy decoding is fine there."""
    if cfg.temperature == 0:
        raise ConfigError(
            "config key 'temperature' is 0 (greedy): the n_samples_per_prompt samples of a "
            "prompt would all be the same, so no group could tell a better response from a "
            "worse one, and greedy outputs are not samples of the policy the update assumes; "
            "training needs temperature > 0 (1.0 samples the policy as it is; "
            "eval.temperature may be 0)"
        )
    truncating = cfg.top_p < 1.0 or cfg.top_k > 0
    if truncating and cfg.engine.backend == "sglang":
        raise ConfigError(
            f"top_p={cfg.top_p} / top_k={cfg.top_k} with engine.backend=sglang: SGLang "
            f"returns log-probs of the untruncated distribution, not of the one it sampled "
            f"from, so the importance weights and mismatch metrics would be wrong; train "
            f"with engine.backend=native (its log-probs are renormalised over the kept "
            f"tokens) or top_p=1.0 and top_k=-1"
        )


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_config(cfg: Config) -> str:
    """YAML that load_config reads back to an equal Config (saved next to checkpoints)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)
