"""ModelDrafter: a small causal LM on the CPU that drafts chains or token trees.

Per request the drafter keeps the context and a KV cache (in the backend) of the tokens it has
already run through the model. ``extend`` only appends tokens; the next ``draft_batch`` rolls the
cache back to the longest prefix that still matches the context (rejected draft tokens go away,
accepted ones are reused) and feeds the rest. Drafting then grows each request's tree level by level:

* a chain (``DraftRequest.tree`` False): the model's greedy continuation, ``budget`` tokens;
* a tree: at each depth in ``tree_branch_depths`` every frontier node gets its ``tree_top_k`` most
  likely children, elsewhere one; each level keeps the children with the highest path probability
  that fit the budget.

Every node carries ``probs`` = the model's softmax probability of its token given its path, so
composition (``["suffix", "model"]``) can score the draft. All requests of a call advance together:
one backend forward per tree level for the whole batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.config import ConfigError
from specdec.drafters.base import Drafter, DraftRequest
from specdec.drafters.base import token_ids as checked_ids
from specdec.drafters.model_backends import DraftBackend, StepInput, make_backend
from specdec.drafters.model_compat import (
    TOKENIZER_FILES,
    check_draft_target,
    check_tokenizer_compat,
    config_vocab_size,
    has_tokenizer,
)
from specdec.drafters.model_config import (
    AUTO_BF16,
    AUTO_CANDIDATES,
    AUTO_SHARED_HOST,
    NATIVE_BACKENDS,
    ModelDrafterConfig,
    auto_candidates,
)
from specdec.tree import ROOT, TokenTree

__all__ = [  # ModelDrafter and the public names of model_config and model_compat, re-exported
    "AUTO_BF16",
    "AUTO_CANDIDATES",
    "AUTO_SHARED_HOST",
    "NATIVE_BACKENDS",
    "TOKENIZER_FILES",
    "ModelDrafter",
    "ModelDrafterConfig",
    "auto_candidates",
    "check_draft_target",
    "check_tokenizer_compat",
    "config_vocab_size",
    "has_tokenizer",
]

logger = logging.getLogger("specdec.drafters.model")


# ------------------------------------------------------------------ per-request state
@dataclass
class _Request:
    tokens: list[int]  # full context (prompt + emitted tokens)
    state: Any  # backend KV cache
    cached: list[int] = field(default_factory=list)  # tokens whose KV sits in slots 0.. of `state`
    offset: int = 0  # the model sees tokens[offset:] (context longer than the model's window)
    stable: int = 0  # cached[:stable] == tokens[offset:][:stable] is known (no need to compare again)


@dataclass
class _Growth:
    """One request's tree under construction during a draft_batch call."""

    req: _Request
    budget: int
    tree: bool
    base: int  # cache length before the first draft node (= slots of the context)
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    path_prob: list[float] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)  # nodes (or ROOT) whose children are chosen next
    fed: int = 0  # nodes whose KV is in the cache (slots base .. base + fed)

    def done(self) -> bool:
        return len(self.tokens) >= self.budget or not self.frontier


class ModelDrafter(Drafter):
    """Draft tokens with a small causal LM on the CPU (see the module docstring)."""

    name = "model"
    Config = ModelDrafterConfig

    def __init__(self, config: ModelDrafterConfig | None = None) -> None:
        self.config = config or ModelDrafterConfig()
        path = self.config.resolved_path()
        if not (path / "config.json").exists():
            raise ConfigError(
                f"path={str(path)!r} is not a Hugging Face model folder (no config.json); "
                "set path to a draft model folder or put the shared folder beside the repo"
            )
        if self.config.target_tokenizer:
            check_tokenizer_compat(path, self.config.target_tokenizer)
        from specdec.drafters.cpu_info import apply_placement

        # the native backend takes num_threads for its own pool: torch's thread count (vLLM's, when the drafter
        # runs inside its engine process) is left alone
        own_pool = self.config.backend in NATIVE_BACKENDS
        self.cpu = apply_placement(
            num_threads=0 if own_pool else self.config.num_threads, cpu_affinity=self.config.cpu_affinity
        )
        self.backend: DraftBackend = self._build_backend(path)
        self._path: Path | None = path
        self._reqs: dict[str, _Request] = {}
        self.forwards = 0  # backend forward calls (for tests and stats)

    @classmethod
    def from_backend(cls, backend: DraftBackend, config: ModelDrafterConfig | None = None) -> ModelDrafter:
        """A drafter over an already built backend (benchmarks; sharing one backend is not thread-safe)."""
        self = cls.__new__(cls)
        self.config, self.backend, self._reqs, self.forwards = config or cls.Config(), backend, {}, 0
        self._path = None
        return self

    def _build_backend(self, path: Path) -> DraftBackend:
        if self.config.backend != "auto":
            return make_backend(
                self.config.backend, path, onnx_spin=self.config.onnx_spin, threads=self.config.num_threads
            )
        from specdec.drafters.model_calibrate import pick_backend

        candidates = auto_candidates(self.cpu.features, shared_host=self.config.shared_host)
        return pick_backend(
            path,
            candidates,
            steps=self.config.calibration_steps,
            onnx_spin=self.config.onnx_spin,
            threads=self.config.num_threads,
        )

    def check_target(self, *, vocab_size: int, tokenizer_dir: str | None = None) -> None:
        """Refuse a target whose tokenizer (or, without one to compare, vocabulary size) differs from the draft
        model's: every draft would be rejected."""
        path = getattr(self, "_path", None)  # None: built over a backend (from_backend), no folder to read
        own = int(getattr(self.backend, "vocab_size", 0) or 0)
        if path is not None and (path / "config.json").exists():
            check_draft_target(path, target_dir=tokenizer_dir, target_vocab=vocab_size)
        elif own and own != vocab_size:
            raise ConfigError(
                f"the draft model has a vocabulary of {own} tokens, the target {vocab_size}: a draft "
                "model must share the target's tokenizer"
            )

    # ------------------------------------------------------------------ lifecycle
    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        tokens = self._checked(prompt_ids)
        if request_id in self._reqs:
            self.stop(request_id)
        self._reqs[request_id] = _Request(tokens=tokens, state=self.backend.new_state())

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        req = self._reqs.get(request_id)
        if req is None:
            raise KeyError(f"request_id={request_id!r} was never started (call start() first)")
        req.tokens.extend(self._checked(token_ids))

    def _checked(self, token_ids: Sequence[int]) -> list[int]:
        """The ids as ints; a ValueError for an id outside the draft model's vocabulary (it has no embedding)."""
        tokens = checked_ids(token_ids)
        vocab = int(getattr(self.backend, "vocab_size", 0) or 0)
        if tokens and vocab and not 0 <= min(tokens) <= max(tokens) < vocab:
            bad = next(t for t in tokens if not 0 <= t < vocab)
            raise ValueError(
                f"token id {bad} is outside the draft model's vocabulary [0, {vocab}): the context "
                "comes from another tokenizer"
            )
        return tokens

    def stop(self, request_id: str) -> None:
        req = self._reqs.pop(request_id, None)
        if req is not None:
            self.backend.release(req.state)

    def draft_after(
        self, request_id: str, extra_tokens: Sequence[int], budget: int, *, tree: bool = False
    ) -> TokenTree:
        """Draft as if ``extra_tokens`` followed the context; the context is restored afterwards.

        The KV cache keeps what it computed (rolled back lazily by the prefix match of the next draft), so a
        hedge that turns out right leaves the cache warm; drafts stay a pure function of the context.
        """
        req = self._reqs.get(request_id)
        if req is None:
            raise KeyError(f"request_id={request_id!r} was never started (call start() first)")
        n, offset = len(req.tokens), req.offset
        req.tokens.extend(int(t) for t in extra_tokens)
        try:
            return self.draft_batch([DraftRequest(request_id, budget, tree)])[0]
        finally:
            del req.tokens[n:]
            req.stable = min(req.stable, n - req.offset)
            if req.offset != offset:  # the window moved for the hypothetical context: restart it lazily
                req.offset, req.cached, req.stable = offset, [], 0

    def active_requests(self) -> list[str]:
        return list(self._reqs)

    def close(self) -> None:
        for rid in list(self._reqs):
            self.stop(rid)

    # ------------------------------------------------------------------ drafting
    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        out: list[TokenTree] = [TokenTree.empty()] * len(requests)
        todo: list[tuple[int, DraftRequest]] = []
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError(f"draft_batch got a request id twice: {[r.request_id for r in requests]}")
        for i, r in enumerate(requests):
            if r.request_id not in self._reqs:
                raise KeyError(f"request_id={r.request_id!r} was never started (call start() first)")
            if r.budget > 0 and self._reqs[r.request_id].tokens:
                todo.append((i, r))
        step = self.config.max_batch
        for lo in range(0, len(todo), step):
            chunk = todo[lo : lo + step]
            trees = self._draft_chunk([r for _, r in chunk])
            for (i, _), t in zip(chunk, trees):
                out[i] = t
        return out

    def _draft_chunk(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        growths = [self._sync(self._reqs[r.request_id], r) for r in requests]
        items = [self._catch_up_input(g) for g in growths]
        live = growths
        fused = getattr(self.backend, "forward_topk", None)  # the backend ranks candidates inside its forward
        while live:
            kmax = max(self._branching(g, d) for g in live for d in self._frontier_depths(g))
            if fused is not None:
                probs, toks = fused(items, kmax)  # rows of every request's frontier, in order
            else:
                probs, toks = _top_candidates(torch.cat(self.backend.forward(items)), kmax)
            self.forwards += 1
            row = 0
            for g in live:
                f = len(g.frontier)
                self._expand(g, probs[row : row + f], toks[row : row + f])
                row += f
            live = [g for g in live if not g.done()]
            items = [self._level_input(g) for g in live]
        for g in growths:
            self._commit(g)
        return [self._to_tree(g) for g in growths]

    def _sync(self, req: _Request, r: DraftRequest) -> _Growth:
        """Roll the cache back to the longest prefix of the context it matches (>= 1 token left to feed)."""
        budget = min(r.budget, self.backend.max_positions // 2)
        if len(req.tokens) - req.offset + budget > self.backend.max_positions:
            # Context outgrew the model's window: restart on the recent half of it.
            req.offset = len(req.tokens) - self.backend.max_positions // 2
            req.cached, req.stable = [], 0
        seen = req.tokens[req.offset :]
        known = min(req.stable, len(req.cached), len(seen))
        keep = min(known + _common_prefix(req.cached[known:], seen[known:]), len(seen) - 1)
        self.backend.crop(req.state, keep)
        req.cached, req.stable = req.cached[:keep], min(req.stable, keep)
        return _Growth(req=req, budget=budget, tree=r.tree, base=len(seen), frontier=[ROOT])

    def _catch_up_input(self, g: _Growth) -> StepInput:
        seen = g.req.tokens[g.req.offset :]
        start = len(g.req.cached)
        new = seen[start:]  # [n >= 1]
        g.req.cached = list(seen)
        g.req.stable = len(seen)
        return StepInput(g.req.state, new, list(range(start, len(seen))), want=[len(new) - 1])

    def _branching(self, g: _Growth, depth: int) -> int:
        return self.config.tree_top_k if g.tree and depth in self.config.tree_branch_depths else 1

    @staticmethod
    def _frontier_depths(g: _Growth) -> set[int]:
        return {1 if p == ROOT else g.depth[p] + 1 for p in g.frontier}

    def _expand(self, g: _Growth, probs: list[list[float]], toks: list[list[int]]) -> None:
        """Add the children of every frontier node within the budget.

        ``probs``/``toks`` [len(frontier), kmax]: each frontier node's most likely next tokens, best first.
        """
        cands: list[tuple[float, int, int, float]] = []  # (path prob, parent, token, prob)
        for prow, trow, parent in zip(probs, toks, g.frontier):
            depth = 1 if parent == ROOT else g.depth[parent] + 1
            k = min(self._branching(g, depth), g.budget - len(g.tokens))
            base = 1.0 if parent == ROOT else g.path_prob[parent]
            cands.extend((base * p, parent, t, p) for p, t in zip(prow[:k], trow[:k]))
        cands.sort(key=lambda c: -c[0])
        cands = cands[: g.budget - len(g.tokens)]
        cands.sort(key=lambda c: c[1])  # keep parents before children and siblings grouped
        g.frontier = []
        for pp, parent, tok, p in cands:
            g.frontier.append(len(g.tokens))
            g.tokens.append(tok)
            g.parents.append(parent)
            g.probs.append(p)
            g.path_prob.append(pp)
            g.depth.append(1 if parent == ROOT else g.depth[parent] + 1)

    def _level_input(self, g: _Growth) -> StepInput:
        """Feed the nodes added since the last forward; they attend to the context and their ancestors."""
        new = list(range(g.fed, len(g.tokens)))  # node ids, == frontier
        positions = [g.base + g.depth[i] - 1 for i in new]
        mask = None
        if not _is_chain(g.parents, len(g.tokens)):
            cached = g.base + g.fed
            mask = np.zeros((len(new), cached + len(new)), dtype=bool)  # [n, cached + n]
            mask[:, : g.base] = True
            for row, node in enumerate(new):
                cur = node
                while cur != ROOT:
                    mask[row, g.base + cur] = True
                    cur = g.parents[cur]
        g.fed = len(g.tokens)
        return StepInput(g.req.state, [g.tokens[i] for i in new], positions, want=list(range(len(new))), mask=mask)

    def _commit(self, g: _Growth) -> None:
        """Keep the draft nodes whose cache slots form a plain chain after the context; drop the rest."""
        keep = 0
        while keep < g.fed and g.parents[keep] == keep - 1:
            keep += 1
        self.backend.crop(g.req.state, g.base + keep)
        g.req.cached = g.req.cached[: g.base] + g.tokens[:keep]

    @staticmethod
    def _to_tree(g: _Growth) -> TokenTree:
        if not g.tokens:
            return TokenTree.empty()
        return TokenTree(
            np.asarray(g.tokens, np.int64), np.asarray(g.parents, np.int32), np.asarray(g.probs, np.float32)
        )

    def memory_bytes(self) -> int:
        return (
            sum(self.backend.state_bytes(r.state) for r in self._reqs.values())
            if hasattr(self.backend, "state_bytes")
            else 0
        )


def _top_candidates(logits: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Softmax probabilities and ids of the ``k`` most likely tokens of each row of ``logits`` [F, V]."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [F, 1]
    vals, toks = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)  # [F, k]
    return torch.exp(vals - lse).tolist(), toks.tolist()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _is_chain(parents: Sequence[int], n: int) -> bool:
    return all(parents[i] == i - 1 for i in range(n))
