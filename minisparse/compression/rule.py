"""What every compression rule shares: given each cached token's score, keep the top
budget - window older tokens plus the last `window`; in batches of rows (sequences x
layers folded together), in chunks sized so the scratch memory stays under a cap.
A row's first `protected` positions (its prompt, under compress.keep_prompt) are never
evicted and do not count against the budget: the selection is over the positions after
them, ranked by the same scores.

A rule is a ScoringRule subclass with score_batch(). `compress.algorithm` names it: a
shipped rule by its file name in minisparse/compression/rules/ (that module's one
subclass), a rule of the user's own as module.path:ClassName; rule_class() resolves both
the same way and check_rule() runs it before any model loads.
select() serves one sequence in one layer; select_batch() many rows at once.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from minisparse.config.schema import CompressConfig, ConfigError, rule_names
from minisparse.utils.user_code import UserCodeError, raised

from .scoring import position_mask

DEFAULT_CHUNK_BYTES = 1 << 30


class RuleError(UserCodeError):
    """A rule's score_batch raised, or returned what cannot be ranked: one line naming the
    rule (compress.algorithm), what was wrong and where in the rule's file, said when a
    rollout compresses."""


class ScoringRule:
    """A KV-cache compression rule: subclasses say how each cached token scores
    (score_batch, higher = keep); this class selects by those scores.

    Its settings are a CompressConfig's (budget, window, selection, and whatever the rule
    reads), checked where the config is loaded (validate_config). chunk_bytes caps
    select_batch's scratch memory; it is the device's limit, not a setting.
    uses_queries: False for rules that score without the recent queries; the engine then
    keeps no query ring for them and they get queries=None.
    name: what a run's report calls the rule (R-KV); a subclass that sets none is called
    by its class name, not by its parent's.
    """

    uses_queries = True
    name = "ScoringRule"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.name = cls.__dict__.get("name", cls.__name__)

    def __init__(self, cfg: CompressConfig, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        _check(chunk_bytes > 0, "chunk_bytes", f"must be > 0, got {chunk_bytes}")
        self.cfg = cfg
        self.chunk_bytes = chunk_bytes

    # ---- what a rule implements -------------------------------------------------------

    def score_batch(self, keys: torch.Tensor, queries: torch.Tensor | None,
                    lengths: torch.Tensor) -> torch.Tensor:
        """Scores [B, H_kv, Lmax] of padded rows, higher = keep. keys [B, H_kv, Lmax, D]
        (post-RoPE, newest last), queries [B, H_q, W, D] (None when uses_queries is
        False), lengths [B]. Only positions < lengths[b] - W are ranked; the rest may hold
        anything (the caller masks them)."""
        raise NotImplementedError(f"{type(self).__name__} must define score_batch()")

    def scratch_bytes(self, keys: torch.Tensor, queries: torch.Tensor | None) -> int:
        """Peak temporary bytes of scoring and selecting one row, which sizes the chunks
        of select_batch. This default (a few float32 / int64 values per token) suits rules
        whose scores are elementwise; a rule that builds larger tensors says so."""
        return 16 * keys.shape[1] * keys.shape[2] + 1

    # ---- the engine sizes its KV pool and its compactions by these two ----------------

    @property
    def budget(self) -> int:
        return self.cfg.budget

    @property
    def window(self) -> int:
        return self.cfg.window

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"

    # ---- public API -------------------------------------------------------------------

    def select(self, keys: torch.Tensor, queries: torch.Tensor | None = None,
               protected: int = 0) -> torch.Tensor:
        """Kept positions of one sequence in one layer: LongTensor
        [H_kv, min(L, protected + budget)].

        keys [H_kv, L, D] (post-RoPE, newest last), queries [H_q, W, D] (the last W
        positions' post-RoPE queries; rules that use none take None); protected: the
        leading positions always kept, outside the budget. Ascending per head; all L
        positions when L <= protected + budget.
        """
        self._check_single(keys, queries)
        h_kv, length = keys.shape[0], keys.shape[1]
        _check(protected >= 0, "protected", f"must be >= 0, got {protected}")
        if length <= protected + self.budget:
            return torch.arange(length, device=keys.device).expand(h_kv, length).contiguous()
        lengths = torch.tensor([length], device=keys.device)
        first = torch.tensor([protected], device=keys.device)
        kept = self._select_rows(keys.unsqueeze(0), _unsqueeze(queries), lengths, first)[0]
        prefix = torch.arange(protected, device=keys.device).expand(h_kv, protected)
        return torch.cat([prefix, kept], dim=-1)

    def score(self, keys: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
        """The scores select() ranks the L - W older tokens by: [H_kv, L - W], float32
        (float64 for float64 inputs), before "per_layer" sums them over heads.
        For diagnostics and tests (judging selections where scores tie)."""
        self._check_single(keys, queries)
        length = keys.shape[1]
        _check(length > self.window, "keys", f"need more than window={self.window} tokens")
        lengths = torch.tensor([length], device=keys.device)
        queries = _unsqueeze(queries) if self.uses_queries else None
        scores = self._scores(keys.unsqueeze(0), queries, lengths)
        return scores[0, :, : length - self.window]

    def select_batch(
        self,
        keys: torch.Tensor,
        queries: torch.Tensor | None,
        lengths: torch.Tensor,
        chunk_bytes: int | None = None,
        protected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Kept positions of many rows: LongTensor [B, H_kv, budget], ascending per row.

        keys [B, H_kv, Lmax, D] padded past lengths[b], queries [B, H_q, W, D] (or None),
        lengths [B] with protected[b] + budget < lengths[b] <= Lmax. Row b equals
        select(keys[b, :, :lengths[b]], queries[b], protected[b]) without its first
        protected[b] positions, which are kept where they are (None: no row has any).
        chunk_bytes overrides the rule's scratch-memory cap for this call.
        """
        _check(keys.dim() == 4, "keys",
               f"must be [B, H_kv, Lmax, D], got shape {tuple(keys.shape)}")
        if queries is not None:
            _check(queries.dim() == 4, "queries",
                   f"must be [B, H_q, W, D], got shape {tuple(queries.shape)}")
        self._check_shapes(keys, queries)
        _check(lengths.shape == (keys.shape[0],), "lengths",
               f"must have shape ({keys.shape[0]},), got {tuple(lengths.shape)}")
        _check(not lengths.is_floating_point(), "lengths", "must be an integer tensor")
        if keys.shape[0] == 0:
            return torch.empty(0, keys.shape[1], self.budget, dtype=torch.long,
                               device=keys.device)
        if protected is None:
            protected = torch.zeros_like(lengths)
        _check(protected.shape == lengths.shape, "protected",
               f"must have shape {tuple(lengths.shape)}, got {tuple(protected.shape)}")
        lo, hi = int((lengths - protected.to(lengths.device)).min()), int(lengths.max())
        _check(lo > self.budget, "lengths",
               f"must all exceed protected + budget={self.budget}, by {lo - self.budget} "
               f"at least")
        _check(hi <= keys.shape[2], "lengths", f"must be <= Lmax={keys.shape[2]}, max {hi}")
        lengths = lengths.to(device=keys.device, dtype=torch.long)
        protected = protected.to(device=keys.device, dtype=torch.long)
        step = self.rows_per_chunk(keys, queries, chunk_bytes)
        parts = [
            self._select_rows(keys[i:i + step],
                              None if queries is None else queries[i:i + step],
                              lengths[i:i + step], protected[i:i + step])
            for i in range(0, keys.shape[0], step)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def rows_per_chunk(
        self, keys: torch.Tensor, queries: torch.Tensor | None, chunk_bytes: int | None = None
    ) -> int:
        """How many rows one chunk of select_batch processes under the memory cap."""
        cap = self.chunk_bytes if chunk_bytes is None else chunk_bytes
        return max(1, cap // self.scratch_bytes(keys, queries))

    def select_scored(self, scores: torch.Tensor, lengths: torch.Tensor,
                      protected: torch.Tensor) -> torch.Tensor:
        """select_batch's kept positions [B, H_kv, budget] from scores [B, H_kv, Lmax]
        already computed (the engine's fused scoring kernels compute them without
        score_batch); positions from lengths[b] - window on and below protected[b] may
        hold anything."""
        rows, h_kv, lmax = scores.shape
        older = position_mask(lengths - self.window, lmax) & ~position_mask(protected, lmax)
        older = older[:, None, :]
        scores = scores.masked_fill(~older, float("-inf"))
        if self.cfg.selection == "per_layer":
            scores = scores.sum(dim=1, keepdim=True)
        top = scores.topk(self.budget - self.window, dim=-1, sorted=False).indices
        recent = torch.arange(self.window, device=scores.device) - self.window
        recent = (lengths[:, None] + recent).unsqueeze(1).expand(rows, h_kv, -1)
        return ascending(torch.cat([top.expand(rows, h_kv, -1), recent], dim=-1), lmax)

    # ---- internals --------------------------------------------------------------------

    def _select_rows(
        self, keys: torch.Tensor, queries: torch.Tensor | None, lengths: torch.Tensor,
        protected: torch.Tensor,
    ) -> torch.Tensor:
        """Top budget - W older tokens by score (from protected[b] on) plus the last W
        tokens, sorted."""
        scores = self._scores(keys, queries if self.uses_queries else None, lengths)
        return self.select_scored(scores, lengths, protected)

    def _scores(self, keys: torch.Tensor, queries: torch.Tensor | None,
                lengths: torch.Tensor) -> torch.Tensor:
        """score_batch's scores, or RuleError naming the rule when it raises or returns
        anything but floating-point scores [B, H_kv, Lmax], one per cached key."""
        rule = f"{_setting(self.cfg.algorithm)}: {type(self).__name__}.score_batch"
        try:
            scores = self.score_batch(keys, queries, lengths)
        except Exception as exc:
            raise RuleError(f"{rule} raised {raised(exc)}") from exc
        want = tuple(keys.shape[:3])
        if not isinstance(scores, torch.Tensor):
            raise RuleError(f"{rule} returned {type(scores).__name__}, not a tensor of "
                            f"scores [B, H_kv, Lmax] = {list(want)}")
        if tuple(scores.shape) != want or not scores.is_floating_point():
            raise RuleError(f"{rule} returned {scores.dtype} scores of shape "
                            f"{list(scores.shape)}; keys {list(keys.shape)} need floating-"
                            f"point scores [B, H_kv, Lmax] = {list(want)}, one per cached key")
        return scores

    def _check_single(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        """One row's shapes: keys [H_kv, L, D], queries [H_q, W, D] or None."""
        _check(keys.dim() == 3, "keys", f"must be [H_kv, L, D], got shape {tuple(keys.shape)}")
        if queries is not None:
            _check(queries.dim() == 3, "queries",
                   f"must be [H_q, W, D], got shape {tuple(queries.shape)}")
        self._check_shapes(keys.unsqueeze(0), _unsqueeze(queries))

    def _check_shapes(self, keys: torch.Tensor, queries: torch.Tensor | None) -> None:
        """Batched shapes: keys [B, H_kv, L, D], queries [B, H_q, W, D] (or None where the
        rule uses none)."""
        if queries is None:
            _check(not self.uses_queries, "queries",
                   f"{type(self).__name__} scores with the last window's queries; got None")
            return
        (rows, h_kv, _, dim), (q_rows, h_q, window, q_dim) = keys.shape, queries.shape
        _check(q_rows == rows, "queries", f"batch {q_rows} != keys batch {rows}")
        _check(q_dim == dim, "queries", f"head dim {q_dim} != keys head dim {dim}")
        _check(window == self.window, "queries",
               f"hold {window} positions, the rule's window is {self.window}")
        _check(h_kv >= 1 and h_q % h_kv == 0, "queries",
               f"query heads {h_q} must be a multiple of KV heads {h_kv}")
        _check(keys.dtype == queries.dtype, "queries",
               f"dtype {queries.dtype} != keys dtype {keys.dtype}")
        _check(keys.device == queries.device, "queries",
               f"device {queries.device} != keys device {keys.device}")


def rule_class(spec: str) -> type[ScoringRule]:
    """The ScoringRule subclass compress.algorithm names: module.path:ClassName, or a
    shipped rule's name (rules/NAME.py, the one subclass it defines). A ConfigError, one
    line naming the setting, for a module that does not import or a class that is missing
    or no ScoringRule."""
    module_name, colon, class_name = spec.partition(":")
    if not colon:  # a shipped rule: the one ScoringRule subclass of rules/NAME.py
        _check(spec in rule_names(), _setting(spec),
               f"no rule {spec} in minisparse/compression/rules/ "
               f"({', '.join(rule_names())}); a rule of your own is module.path:ClassName",
               ConfigError)
        return _only_rule(spec, _import_rule_module(spec, f"{__package__}.rules.{spec}"))
    found = getattr(_import_rule_module(spec, module_name), class_name, None)
    _check(found is not None, _setting(spec), f"module {module_name} has no class {class_name}",
           ConfigError)
    _check(isinstance(found, type) and issubclass(found, ScoringRule)
           and found is not ScoringRule, _setting(spec),
           f"{class_name} in module {module_name} is not a ScoringRule subclass", ConfigError)
    return found


def check_rule(cfg: CompressConfig) -> None:
    """Imports the rule cfg.algorithm names (none: nothing), so that a typo in a module
    or class name costs a second before any model loads, not a model load."""
    if cfg.algorithm != "none":
        rule_class(cfg.algorithm)


def _import_rule_module(spec: str, module_name: str) -> ModuleType:
    """The module a rule lives in; ConfigError when it is not found or fails to import."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        own = module_name == exc.name or module_name.startswith(f"{exc.name}.")
        hint = " (is its folder on sys.path, e.g. PYTHONPATH?)" if own else ""
        raise ConfigError(f"{_setting(spec)}: cannot import module {module_name}: "
                          f"{exc}{hint}") from None
    except Exception as exc:  # the module itself failed while importing
        raise ConfigError(f"{_setting(spec)}: importing module {module_name} raised "
                          f"{type(exc).__name__}: {exc}") from None


def _only_rule(spec: str, module: ModuleType) -> type[ScoringRule]:
    """The one ScoringRule subclass a shipped rule's file defines."""
    found = [v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, ScoringRule)
             and v.__module__ == module.__name__]
    _check(len(found) == 1, _setting(spec),
           f"rules/{spec}.py must define exactly one ScoringRule subclass, found "
           f"{[c.__name__ for c in found]}", ConfigError)
    return found[0]


def _setting(spec: str) -> str:
    """How a rule's errors name the setting: compress.algorithm='my_rules:MyRule'."""
    return f"compress.algorithm={spec!r}"


def build_rule(cfg: CompressConfig) -> ScoringRule | None:
    """The rule a config asks for; None when algorithm is "none" (dense rollouts)."""
    return None if cfg.algorithm == "none" else rule_class(cfg.algorithm)(cfg)


def ascending(positions: torch.Tensor, lmax: int) -> torch.Tensor:
    """positions (< lmax) sorted along the last axis, as int64. Sorted as the narrowest
    integer that holds lmax: a radix sort's passes scale with the key's bytes, and the
    int64 sort of a 256-sequence compaction of the 1.5B took 0.55 ms of its 6.5. (The
    top-k before it is unsorted for the same reason: its order is thrown away here.)"""
    narrow = torch.int16 if lmax <= torch.iinfo(torch.int16).max else torch.int32
    return positions.to(narrow).sort(dim=-1).values.long()


def _unsqueeze(queries: torch.Tensor | None) -> torch.Tensor | None:
    return None if queries is None else queries.unsqueeze(0)


def _check(ok: bool, name: str, message: str,
           error: type[ValueError] = ValueError) -> None:
    """Raise `error` naming the offending parameter (or setting: ConfigError)."""
    if not ok:
        raise error(f"{name}: {message}")
