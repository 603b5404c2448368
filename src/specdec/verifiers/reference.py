"""Reference tree verifier: checks draft token trees against a Hugging Face causal LM (CPU or CUDA).

Glossary (the one place these terms are defined; other modules refer here)
--------------------------------------------------------------------------
step
    One verification of one request: the target reads ``[last emitted token] + draft tree`` in ONE
    forward pass and the request emits at least one token. In a batch, each request's verification
    counts as one step (``SpecStats.steps`` sums over requests).
drafted tokens
    The nodes of a request's draft tree for a step (at most the budget).
accepted tokens
    Draft tokens the verifier keeps: the longest root path of the tree that agrees with the target
    (greedy: each is the target's argmax given the tokens before it; sampling: each passed the
    rejection test of ``specdec.sampling``). They are emitted as they are.
rejected tokens
    Drafted tokens that are not accepted (siblings of the accepted path, and everything below the
    first node whose children all failed). Their KV-cache entries are dropped.
recovered token
    The token the target emits where the accepted path stops at a node that has children: the argmax
    (greedy) or a sample from the residual distribution (sampling: the target distribution with the
    rejected children's mass removed and renormalised). It replaces the rejected draft tokens.
bonus token
    The token the target emits after an accepted path that ends at a leaf (or after the root when
    there is no draft): the argmax / a sample of the full target distribution there. Every step emits
    exactly one recovered-or-bonus token, so a step emits ``accepted + 1`` tokens (fewer only when
    EOS or ``max_new_tokens`` cuts it).
MAT (mean accepted tokens per step)
    ``emitted tokens / steps``, the bonus/recovered token included: 1.0 means drafting never helped;
    plain decoding has MAT 1.
acceptance rate
    ``accepted tokens / drafted tokens`` over all steps (a tree drafts siblings that can never all be
    accepted, so trees have lower acceptance rates at equal MAT).

How a step works
----------------
The cache holds every committed token of a request except the last one (the "root"). A step feeds
``[root] + tree nodes`` (padded to the longest tree of the batch) at positions ``p0 + depth`` with a
4D additive mask: each input sees the request's valid cache entries plus its tree ancestors and
itself (``TokenTree.ancestor_mask``); padding inputs see only themselves. After acceptance the cache
is rewound by gathering, per request, its old valid entries followed by the root's and the accepted
nodes' entries (left-aligned; shorter rows are padded and masked), which drops rejected entries.
Positions are explicit, so keys computed for a node at ``p0 + depth`` are exactly the keys the token
would get in plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specdec.hf_cache import cache_kwargs
from specdec.sampling import SamplingParams, accept
from specdec.tree import TokenTree


@dataclass
class StepOutcome:
    """What one request got from one verification step."""

    accepted: list[int]  # accepted node indices, top first
    tokens: list[int]  # emitted tokens: the accepted draft tokens, then the recovered/bonus token
    drafted: int  # nodes in the verified tree

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


class ReferenceVerifier:
    """Batched tree verification with a KV cache for a Hugging Face causal LM (e.g. LlamaForCausalLM).

    v = ReferenceVerifier(model, sampling=SamplingParams(), seed=0)
    v.reset(prompts)                       # prefill; rows = prompts
    outcomes = v.step(trees)               # one tree per active row (TokenTree.empty() for none)
    v.select(rows_to_keep)                 # drop finished rows
    """

    def __init__(
        self, model: torch.nn.Module, *, sampling: SamplingParams | None = None, seed: int | None = None
    ) -> None:
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.sampling = sampling or SamplingParams()
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None and 0 <= int(pad) < self.vocab_size else 0
        self.cache = None  # transformers DynamicCache
        self.cache_len = torch.zeros(0, dtype=torch.long)  # [B] valid (left-aligned) cache entries per row
        self.last = torch.zeros(0, dtype=torch.long)  # [B] root token of each row (not in the cache)
        self.forward_passes = 0

    @property
    def batch_size(self) -> int:
        return int(self.last.numel())

    # ----------------------------------------------------------------------------- prefill
    @torch.inference_mode()
    def reset(self, prompts: Sequence[Sequence[int]]) -> None:
        """Start a batch: prefill every prompt but its last token (which becomes the row's root)."""
        from transformers import DynamicCache

        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompts[{i}] is empty: every prompt needs at least one token (e.g. BOS)")
            bad = [t for t in p if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}] has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        self.cache = DynamicCache(config=self.model.config)
        lengths = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long)  # [B]
        self.last = torch.tensor([int(p[-1]) for p in prompts], dtype=torch.long)
        self.cache_len = torch.zeros_like(lengths)
        width = int(lengths.max()) if len(prompts) else 0
        if width == 0:
            return
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, P] right-padded
        for b, p in enumerate(prompts):
            ids[b, : len(p) - 1] = torch.tensor([int(t) for t in p[:-1]], dtype=torch.long)
        q = torch.arange(width)
        causal = q[None, :] <= q[:, None]  # [P, P]
        allowed = causal[None] & (q[None, None, :] < lengths[:, None, None])  # [B, P, P]
        allowed |= torch.eye(width, dtype=torch.bool)[None]  # padding queries see themselves (no NaN)
        positions = q[None].expand(len(prompts), width)
        self._forward(ids, positions, allowed)
        self.cache_len = lengths

    # ----------------------------------------------------------------------------- one step
    @torch.inference_mode()
    def step(self, trees: Sequence[TokenTree]) -> list[StepOutcome]:
        """Verify one tree per row in one forward pass; rewind the cache to the accepted paths."""
        if len(trees) != self.batch_size:
            raise ValueError(f"got {len(trees)} trees for {self.batch_size} active rows; give one per row")
        batch = self.batch_size
        width = 1 + max(len(t) for t in trees)  # N: root + the largest tree
        past = self._cache_width()
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)  # [B, N]
        positions = torch.zeros((batch, width), dtype=torch.long)  # [B, N]
        allowed = torch.zeros((batch, width, past + width), dtype=torch.bool)  # [B, N, L + N]
        allowed[:, :, :past] = torch.arange(past)[None, None, :] < self.cache_len[:, None, None]
        for b, tree in enumerate(trees):
            n = len(tree)
            ids[b, 0] = self.last[b]
            ids[b, 1 : n + 1] = torch.from_numpy(tree.tokens)
            positions[b, : n + 1] = torch.from_numpy(tree.positions(int(self.cache_len[b])))
            positions[b, n + 1 :] = int(self.cache_len[b])
            allowed[b, : n + 1, past : past + n + 1] = torch.from_numpy(tree.ancestor_mask())
            pad_q = torch.arange(n + 1, width)
            allowed[b, pad_q, past + pad_q] = True  # padding queries see only themselves
        logits = self._forward(ids, positions, allowed)  # [B, N, V]
        outcomes = []
        for b, tree in enumerate(trees):
            nodes, token = accept(tree, logits[b, : len(tree) + 1], self.sampling, self.generator)
            outcomes.append(StepOutcome(nodes, [int(tree.tokens[i]) for i in nodes] + [token], len(tree)))
        self._rewind(past, outcomes)
        return outcomes

    def select(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (indices into the current batch), e.g. to drop finished requests."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        self.last = self.last[idx]
        self.cache_len = self.cache_len[idx]
        keep = int(self.cache_len.max()) if idx.numel() else 0
        for layer in self._layers():
            layer.keys = layer.keys[idx.to(self.device), :, :keep]
            layer.values = layer.values[idx.to(self.device), :, :keep]

    # ----------------------------------------------------------------------------- internals
    def _layers(self) -> list:
        if self.cache is None:
            return []
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)]

    def _cache_width(self) -> int:
        layers = self._layers()
        return int(layers[0].keys.shape[-2]) if layers else 0

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """ids/positions [B, N], allowed [B, N, L + N] -> logits [B, N, V] (appends N entries to the cache)."""
        neg = torch.finfo(self.dtype).min
        mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, neg)[:, None]  # [B, 1, N, L+N]
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            **cache_kwargs(self.model, self.cache),
        )
        self.forward_passes += 1
        return out.logits

    def _rewind(self, past: int, outcomes: list[StepOutcome]) -> None:
        """Keep each row's old valid entries + its root and accepted nodes (left-aligned); drop the rest."""
        kept = [[past] + [past + 1 + i for i in o.accepted] for o in outcomes]  # flattened input -> cache column
        new_len = self.cache_len + torch.tensor([len(k) for k in kept], dtype=torch.long)  # [B]
        width = int(new_len.max())
        index = torch.zeros((len(outcomes), width), dtype=torch.long)  # [B, L'] source column of each slot
        for b, cols in enumerate(kept):
            old = int(self.cache_len[b])
            index[b, :old] = torch.arange(old)
            index[b, old : old + len(cols)] = torch.tensor(cols, dtype=torch.long)
        index = index.to(self.device)
        for layer in self._layers():
            heads, dim = layer.keys.shape[1], layer.keys.shape[3]
            gather = index[:, None, :, None].expand(-1, heads, -1, dim)  # [B, H, L', D]
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.cache_len = new_len
        self.last = torch.tensor([o.tokens[-1] for o in outcomes], dtype=torch.long)


def vocab_ok(tree: TokenTree, vocab_size: int) -> bool:
    """True when every token of ``tree`` is a valid id for a vocabulary of ``vocab_size``."""
    return not len(tree) or bool(np.all((tree.tokens >= 0) & (tree.tokens < vocab_size)))
