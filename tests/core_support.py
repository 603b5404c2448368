"""Helpers for the core tests: tiny random Llama targets and test drafters (oracle, noisy, random, ...)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdec.drafters.base import Drafter, DraftRequest
from specdec.tree import ROOT, TokenTree

if TYPE_CHECKING:
    from transformers import LlamaConfig

TINY_VOCAB = 96
# A large init spread gives peaked next-token distributions: greedy argmax margins far above float noise.
TINY_INIT_RANGE = 0.3
SAVED_VOCAB = 97  # vocabulary of the saved tiny Llama of the draft-model backend tests
LLAMA_TOKEN_IDS = (1, 2, None)  # LlamaConfig's own (bos, eos, pad) ids


@dataclass(frozen=True)
class LlamaSpec:
    """What a tiny random Llama is built from: config values, then scalings of the initialized weights.

    ``None`` for ``init_range``, ``rope_theta`` or ``rms_norm_eps`` keeps LlamaConfig's value, as do the default
    ``token_ids``. The MLP is 2 x hidden.
    ``matrix_scale`` scales every matrix (embeddings included), ``qk_scale`` the q/k projections further (large
    attention scores), ``head_scale`` an untied ``lm_head`` (peaked logits); ``random_norms`` sets the norm weights to
    uniform [0.5, 1.5) draws, in parameter order, so a per-feature scaling of them shows.
    """

    vocab: int = TINY_VOCAB
    hidden: int = 48
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    max_pos: int = 512
    init_range: float | None = None
    token_ids: tuple[int | None, int | None, int | None] = LLAMA_TOKEN_IDS  # bos, eos, pad
    tied: bool = False
    rope_theta: float | None = None
    rms_norm_eps: float | None = None
    matrix_scale: float = 1.0
    qk_scale: float = 1.0
    head_scale: float = 1.0
    random_norms: bool = False


# The in-memory targets of the core tests: vocabulary 96, hidden 48, GQA 4/2 heads, a wide init spread.
TINY_SPEC = LlamaSpec(init_range=TINY_INIT_RANGE, token_ids=(0, 0, 1))
# The saved draft-model checkpoints: GQA 4/2 heads, tied embeddings, matrices x4 (sharper distributions than the
# default init, so greedy choices are stable).
SAVED_SPEC = LlamaSpec(vocab=SAVED_VOCAB, hidden=64, tied=True, rope_theta=500.0, matrix_scale=4.0)


def _llama_config(spec: LlamaSpec) -> LlamaConfig:
    from transformers import LlamaConfig

    bos, eos, pad = spec.token_ids
    optional = {"initializer_range": spec.init_range, "rope_theta": spec.rope_theta, "rms_norm_eps": spec.rms_norm_eps}
    return LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=2 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_pos,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=spec.tied,
        **{key: value for key, value in optional.items() if value is not None},
    )


def _scale_weights(model: torch.nn.Module, spec: LlamaSpec) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.mul_(spec.matrix_scale)
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(spec.qk_scale)
            elif spec.random_norms:
                p.copy_(0.5 + torch.rand_like(p))
        if spec.head_scale != 1.0:
            model.lm_head.weight.mul_(spec.head_scale)


def tiny_llama(seed: int = 0, *, spec: LlamaSpec = TINY_SPEC, **changes: Any) -> torch.nn.Module:
    """A seeded random LlamaForCausalLM in float32, eval mode, built from ``spec`` with ``changes`` (its fields)."""
    from transformers import LlamaForCausalLM

    spec = replace(spec, **changes)
    cfg = _llama_config(spec)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    _scale_weights(model, spec)
    return model.float().eval()


def save_tiny_llama(
    path: Path, *, seed: int, spec: LlamaSpec = SAVED_SPEC, tokenizer: Any = None, **changes: Any
) -> Path:
    """``tiny_llama(seed, spec=spec, **changes)`` saved with ``save_pretrained`` to ``path``; returns ``path``.

    ``tokenizer`` (a Hugging Face tokenizer), when given, is saved beside the model.
    """
    tiny_llama(seed, spec=spec, **changes).save_pretrained(str(path))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def load_hf(path: Path) -> torch.nn.Module:
    """The saved model through Hugging Face, float32, eval mode (the reference for backend logits)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[n, V] float32 logits of a full forward over ``ids``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def random_prompts(n: int, *, seed: int, vocab: int = TINY_VOCAB, max_len: int = 12) -> list[list[int]]:
    """``n`` prompts of lengths 1..max_len (different lengths exercise padding)."""
    rs = np.random.RandomState(seed)
    lengths = [1, max_len, 3, 7, 5, 2, 9, 4][:n] + list(rs.randint(1, max_len + 1, size=max(0, n - 8)))
    return [rs.randint(2, vocab, size=int(k)).tolist() for k in lengths]


class _Tracking(Drafter):
    """Keeps each request's context (prompt + extended tokens) and records lifecycle calls."""

    name = "tracking"

    def __init__(self) -> None:
        self.ctx: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.calls: list[tuple[str, str]] = []
        self.extended: dict[str, list[int]] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.calls.append(("start", request_id))
        self.ctx[request_id] = list(prompt_ids)
        self.prompt_len[request_id] = len(prompt_ids)
        self.extended[request_id] = []

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.calls.append(("extend", request_id))
        self.ctx[request_id].extend(int(t) for t in token_ids)
        self.extended[request_id].extend(int(t) for t in token_ids)

    def stop(self, request_id: str) -> None:
        self.calls.append(("stop", request_id))
        self.ctx.pop(request_id, None)

    def active_requests(self) -> list[str]:
        return list(self.ctx)

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        return [self.draft_one(r) for r in requests]

    def draft_one(self, request: DraftRequest) -> TokenTree:
        return TokenTree.empty()


class EmptyDrafter(_Tracking):
    name = "empty"


class OracleDrafter(_Tracking):
    """Drafts the true continuation (``truth[prompt] = plain greedy output``).

    ``noise`` > 0 replaces each drafted token by a wrong one with that probability (partial acceptance).
    In tree mode each depth gets a decoy sibling before the true node, and the decoy gets a child.
    """

    name = "oracle"

    def __init__(
        self, truth: dict[tuple[int, ...], list[int]], *, vocab: int = TINY_VOCAB, noise: float = 0.0, seed: int = 0
    ) -> None:
        super().__init__()
        self.truth, self.vocab, self.noise = truth, vocab, noise
        self.rs = np.random.RandomState(seed)
        self.sizes: list[tuple[int, int]] = []  # (budget, drafted nodes) per draft

    def _continuation(self, rid: str, k: int) -> list[int]:
        ctx = self.ctx[rid]
        n = self.prompt_len[rid]
        cont = list(self.truth[tuple(ctx[:n])][len(ctx) - n :][:k])
        return [
            (t + 1 + int(self.rs.randint(self.vocab - 1))) % self.vocab if self.rs.rand() < self.noise else t
            for t in cont
        ]

    def draft_one(self, request: DraftRequest) -> TokenTree:
        tree = (
            self._tree(request)
            if request.tree
            else TokenTree.chain(self._continuation(request.request_id, request.budget))
        )
        self.sizes.append((request.budget, len(tree)))
        return tree

    def _tree(self, request: DraftRequest) -> TokenTree:
        tokens: list[int] = []
        parents: list[int] = []
        prev = ROOT
        for tok in self._continuation(request.request_id, request.budget):
            if len(tokens) + 3 > request.budget:
                break
            decoy = (tok + 7) % self.vocab
            tokens += [decoy, (decoy + 1) % self.vocab, tok]
            parents += [prev, len(tokens) - 3, prev]
            prev = len(tokens) - 1
        return TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int32))


class RandomDrafter(_Tracking):
    """Random tokens in random tree shapes (distinct sibling tokens), or random chains."""

    name = "random"

    def __init__(self, *, vocab: int = TINY_VOCAB, seed: int = 0, with_probs: bool = False) -> None:
        super().__init__()
        self.vocab, self.with_probs = vocab, with_probs
        self.rs = np.random.RandomState(seed)

    def draft_one(self, request: DraftRequest) -> TokenTree:
        n = int(self.rs.randint(0, request.budget + 1))
        probs = self.rs.rand(n) if self.with_probs else None
        if not request.tree:
            return TokenTree.chain(self.rs.randint(0, self.vocab, size=n), probs)
        tokens: list[int] = []
        parents: list[int] = []
        for i in range(n):
            p = int(self.rs.randint(-1, i)) if i else ROOT
            used = {tokens[j] for j in range(i) if parents[j] == p}
            free = [t for t in range(self.vocab) if t not in used]
            tokens.append(int(self.rs.choice(free)))
            parents.append(p)
        return TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int32), probs)


class RaisingDrafter(OracleDrafter):
    """An oracle that raises on every ``fail_every``-th draft call."""

    name = "raising"

    def __init__(self, truth: dict[tuple[int, ...], list[int]], *, fail_every: int = 2) -> None:
        super().__init__(truth)
        self.fail_every, self.draft_calls = fail_every, 0

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        self.draft_calls += 1
        if self.draft_calls % self.fail_every == 0:
            raise RuntimeError("boom: drafter bug for the test")
        return super().draft_batch(requests)


class OverBudgetDrafter(OracleDrafter):
    """Ignores the budget (drafts ``2 * budget + 3`` tokens): the guard must truncate."""

    name = "over-budget"

    def draft_one(self, request: DraftRequest) -> TokenTree:
        cont = self._continuation(request.request_id, 2 * request.budget + 3)
        return TokenTree.chain(cont + [5] * (2 * request.budget + 3 - len(cont)))


class HFModelDrafter(_Tracking):
    """A plain draft-model drafter for tests: greedy chain, or the greedy chain plus the runner-up token
    as a leaf sibling at each depth (tree). Recomputes the whole context each level (no cache)."""

    name = "hf-model"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model.eval()

    @torch.inference_mode()
    def draft_one(self, request: DraftRequest) -> TokenTree:
        ctx = list(self.ctx[request.request_id])
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        prev = ROOT
        while len(tokens) < request.budget:
            logits = self.model(torch.tensor([ctx])).logits[0, -1]
            p = torch.softmax(logits.float(), -1)
            top = torch.topk(p, 2)
            best, alt = int(top.indices[0]), int(top.indices[1])
            if request.tree and len(tokens) + 2 <= request.budget:
                tokens.append(alt), parents.append(prev), probs.append(float(top.values[1]))
            tokens.append(best), parents.append(prev), probs.append(float(top.values[0]))
            prev = len(tokens) - 1
            ctx.append(best)
        return TokenTree(np.asarray(tokens, np.int64), np.asarray(parents, np.int32), probs)


def target_sequence(seed: int, length: int = 600) -> list[int]:
    """A repetitive token stream (phrases from a small pool, occasional noise tokens): a greedy target's output
    that a suffix drafter sometimes hits and sometimes misses."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(50) for _ in range(rng.randint(3, 9))] for _ in range(6)]
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases) if rng.random() < 0.85 else [rng.randrange(50, 90)]
    return out[:length]
