"""Suffix-tree drafter: frequency-scored drafts from the request's own context and past responses.

Each active request owns a bounded-depth suffix trie over its prompt and output so far; one global trie
holds the responses of finished requests (bounded by ``max_cached_requests`` / ``max_cached_tokens``,
oldest evicted first). At each step the last tokens of the context are matched in both tries (every
match length up to ``max_depth - 1``, kept incrementally: O(depth) per appended token, no rebuild);
from each match a chain (most frequent continuation) or a tree (best-first by path probability) grows
while the path probability stays >= ``min_token_prob``, at most ``budget`` nodes and
``floor(match_len * max_spec_factor + max_spec_offset)`` deep. The draft with the highest expected
number of accepted tokens (sum of path probabilities) wins; ``probs`` carries P(token | its path).
With ``min_confidence`` > 0 a chain token's probability is calibrated instead of count / total: how often the top
continuation of a match like this one (source trie, tokens matched, count, share of its node) was the next token,
learned from every token the library appends (``suffix_calib.py``); chains stop below ``min_confidence``.

Backends: ``native`` (C++ core, ``specdec.drafters._suffix_native``, built by ``pip install -e .``),
``python`` (``specdec.drafters.suffix_ref``, the reference; identical drafts), ``auto`` (native if built).
The native backend also offers the vLLM proposer's one-call step (``suffix_lane.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import mul
from typing import Any

import numpy as np

from specdec.config import ConfigBase, ConfigError, rng
from specdec.drafters.base import MAX_TOKEN_ID, Chain, Drafter, DraftRequest, refuse_text, token_ids
from specdec.drafters.suffix_lane import SuffixLane
from specdec.drafters.suffix_ref import RefEngine
from specdec.tree import TokenTree

try:  # the optional native core (setup.py ext_modules)
    from specdec.drafters._suffix_native import Engine as NativeEngine
except ImportError:  # pragma: no cover - depends on the build
    NativeEngine = None

BACKENDS = ("auto", "native", "python")
SOURCES = ("local", "global")  # which trie produced a draft (engine source index 0 / 1)


def native_available() -> bool:
    return NativeEngine is not None


@dataclass(frozen=True)
class SuffixConfig(ConfigBase):
    max_depth: int = rng(64, lo=2, hi=4096, doc="trie depth: match length + draft length never exceed it")
    max_spec_factor: float = rng(8.0, lo=0.0, hi=1000.0, doc="draft depth <= match_len * factor + offset")
    max_spec_offset: float = rng(0.0, lo=-1000.0, hi=1000.0, doc="see max_spec_factor")
    min_token_prob: float = rng(
        0.1,
        lo=0.0,
        hi=1.0,
        doc="stop growing a path below this path probability (count / total: trees, uncalibrated chains)",
    )
    free_spec_factor: float = rng(
        -1.0,
        lo=-1.0,
        hi=1000.0,
        doc="max_spec_factor for requests whose verification is free (DraftRequest.free: "
        "vLLM batches padded to k); -1: max_spec_factor",
    )
    leaf_prior: float = rng(
        0.0,
        lo=0.0,
        hi=1000.0,
        doc="> 0: a continuation seen once is not certain: (l + 1) / (l + 1 + leaf_prior), l = "
        "tokens matched so far (0: probability 1, as count / total says)",
    )
    min_confidence: float = rng(
        0.0,
        lo=0.0,
        hi=1.0,
        doc="> 0: chains use calibrated probabilities (how often such a continuation: source, tokens matched, count, "
        "share of its node, was the next token so far) and stop below this path probability instead of "
        "min_token_prob; 0: count / total",
    )
    max_cached_requests: int = rng(10_000, lo=0, hi=2**31 - 1, doc="responses kept in the global trie (0: none)")
    max_cached_tokens: int = rng(10_000_000, lo=0, hi=2**40, doc="response tokens kept in the global trie")
    use_local: bool = rng(True, doc="draft from the request's own prompt + output")
    use_global: bool = rng(True, doc="draft from past responses")
    backend: str = rng("auto", choices=BACKENDS, doc="native C++ core, python reference, or auto")


class SuffixDrafter(SuffixLane, Drafter):
    """Suffix-trie drafter (see the module docstring)."""

    name = "suffix"
    Config = SuffixConfig
    draft_options = frozenset(
        (
            "max_spec_factor",
            "max_spec_offset",
            "min_token_prob",
            "free_spec_factor",
            "leaf_prior",
            "use_local",
            "use_global",
            "min_confidence",
        )
    )

    def __init__(self, config: SuffixConfig | None = None, **overrides: Any) -> None:
        config = config or SuffixConfig()
        if overrides:
            config = config.replace(**overrides)
        self.config = config
        backend = config.backend
        if backend == "native" and NativeEngine is None:
            raise ConfigError(
                "backend='native' but specdec.drafters._suffix_native is not built; "
                "run `pip install -e .` with a C++17 compiler, or set backend='python'"
            )
        use_native = NativeEngine is not None and backend != "python"
        engine_cls = NativeEngine if use_native else RefEngine
        self.backend = "native" if use_native else "python"
        self.engine = engine_cls(config.max_depth, config.max_cached_requests, config.max_cached_tokens)
        self._ids: dict[str, int] = {}
        self._next_id = 0
        self.last_sources: list[str] = []  # trie that produced each draft of the last draft_batch call

    # ----------------------------------------------------------------- lifecycle
    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        if request_id in self._ids:
            self.stop(request_id)
        ids = _as_ids(prompt_ids, check=self.backend == "python")
        try:
            self.engine.start(self._new_engine_id(request_id), ids)
        except Exception:  # refused ids: the request was not started
            self._ids.pop(request_id, None)
            raise

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        rid = self._ids.get(request_id)
        if rid is None:
            raise KeyError(f"request {request_id!r} was never started (call start first)")
        if len(token_ids):
            self.engine.extend(rid, _as_ids(token_ids, check=self.backend == "python"))

    def stop(self, request_id: str) -> None:
        rid = self._ids.pop(request_id, None)
        if rid is not None:
            self.engine.stop(rid)

    def cache_response(self, token_ids: Sequence[int]) -> None:
        """Add a finished response that was not drafted here (another replica's, a log's) to the global cache."""
        if len(token_ids):
            self.engine.cache(_as_ids(token_ids, check=self.backend == "python"))

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        out: list[TokenTree] = []
        self.last_sources = []
        for req in requests:
            rid = self._ids.get(req.request_id)
            if rid is None or req.budget <= 0:
                out.append(TokenTree.empty())
                self.last_sources.append("")
                continue
            toks, parents, probs, _score, _m, src = self._engine_draft(rid, req, tree=req.tree)
            self.last_sources.append(SOURCES[src] if src >= 0 else "")
            if not toks:
                out.append(TokenTree.empty())
            elif not req.tree:
                out.append(TokenTree.chain(toks, probs))
            else:  # the engine emits parents in topological order: no re-validation on this hot path
                out.append(
                    TokenTree._trusted(
                        np.asarray(toks, np.int64), np.asarray(parents, np.int32), np.asarray(probs, np.float32)
                    )
                )
        return out

    def draft_chains(self, requests: Sequence[DraftRequest]) -> list[Chain]:
        """Chain drafts straight from the engine (no tree objects): tokens and path probabilities."""
        out: list[Chain] = []
        for req in requests:
            rid = self._ids.get(req.request_id)
            if rid is None or req.budget <= 0:
                out.append(([], None))
                continue
            toks, _parents, probs, _score, _m, _src = self._engine_draft(rid, req, tree=False)
            out.append((toks, list(accumulate(probs, mul)) if toks else None))
        return out

    def _engine_draft(self, rid: int, req: DraftRequest, *, tree: bool) -> tuple:
        """The engine's draft for engine id ``rid``: (tokens, parents, probs, score, match length, source)."""
        c = self.config
        calibrated = c.min_confidence > 0 and not tree  # trees keep count / total
        return self.engine.draft(
            rid,
            min(req.budget, MAX_BUDGET),
            tree,
            self._factor(req.free),
            c.max_spec_offset,
            c.min_confidence if calibrated else c.min_token_prob,
            c.use_local,
            c.use_global,
            c.leaf_prior,
            calibrated,
        )

    def _factor(self, free: bool) -> float:
        """The draft depth cap factor (``free_spec_factor`` for a request whose verification is free)."""
        c = self.config
        return c.free_spec_factor if free and c.free_spec_factor >= 0 else c.max_spec_factor

    # ----------------------------------------------------------------- one-call proposer step (native only)
    def native_lane(self) -> SuffixDrafter | None:
        """This drafter if it offers the one-call proposer step (``lane_step``: native backend), else None. The lane
        drafts the chains ``draft_chains`` would: calibrated ones with ``min_confidence`` > 0 (``lane_config``)."""
        return self if self.backend == "native" else None

    @property
    def request_ids(self) -> dict[str, int]:
        """Active request ids (-> engine ids); read-only."""
        return self._ids

    # ----------------------------------------------------------------- engine ids
    def _new_engine_id(self, request_id: str) -> int:
        """A fresh engine id for the request (the engine starts it under that id)."""
        rid = self._ids[request_id] = self._next_id
        self._next_id += 1
        return rid

    def _forget(self, request_ids: Sequence[str]) -> list[int]:
        """Engine ids of those requests, dropped from the id map (the caller has the engine stop them)."""
        ids = self._ids
        return [ids.pop(r) for r in request_ids if r in ids]

    # ----------------------------------------------------------------- introspection
    def active_requests(self) -> list[str]:
        return list(self._ids)

    def memory_bytes(self) -> int:
        return int(self.engine.memory_bytes())

    def global_stats(self) -> dict[str, int]:
        """Global trie: live nodes, bytes, cached response tokens and requests."""
        return dict(self.engine.global_stats())


MAX_BUDGET = 2**31 - 1  # draft nodes per request: larger budgets are cut to this (no draft can be that large)


def _bad_ids(what: str) -> ValueError:
    return ValueError(f"token ids must be integers in [0, 2**63); got {what}")


def _as_ids(ids: Sequence[int] | np.ndarray, *, check: bool) -> Any:
    """Token ids in a form both engines read fast: int32/int64 arrays (unsigned and narrow ones widened, never
    truncated); lists stay lists, checked here when ``check`` (the Python engine; the native one checks them alike:
    ints only, never a bool or a float). Text and bytes are refused on both."""
    refuse_text(ids)
    if isinstance(ids, np.ndarray):
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise _bad_ids(f"an array of {ids.dtype}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > MAX_TOKEN_ID):
            raise _bad_ids(f"{int(ids.min()) if int(ids.min()) < 0 else int(ids.max())}")
        wide = ids.dtype.itemsize > 4 or ids.dtype == np.uint32
        return np.ascontiguousarray(ids.reshape(-1), dtype=np.int64 if wide else np.int32)
    return token_ids(ids) if check else list(ids)
