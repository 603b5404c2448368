"""Target-side sampling and the lossless acceptance rules for token trees.

Vocabulary (accepted / rejected / recovered / bonus tokens, MAT, acceptance rate): see the glossary in
``specdec.verifiers.reference``.

Two acceptance rules walk a draft tree from the root, given the target's distribution after the root
and after every node (``[n + 1, V]``, flattened index 0 = root, ``i + 1`` = node ``i``):

* greedy (temperature 0): follow the child whose token is the target's argmax
  (``TokenTree.accept_greedy``); the first argmax no child carries is the recovered (or bonus) token;
* sampling: drafts are deterministic (one-hot) proposals, whatever their ``probs`` say (``probs`` are
  drafter scores, not the distribution a token was sampled from). At a node, with ``r`` the target
  distribution there, try the children in index order: accept child ``c`` with probability
  ``r(c) / sum(r)``; otherwise set ``r(c) = 0`` and try the next child. When a child is accepted the
  walk moves into it with a fresh ``r``; when every child is rejected the recovered token is sampled
  from the residual ``r / sum(r)``; at a leaf (no children) that is the bonus token, sampled from the
  full target distribution.

Why sampling is lossless: at one node, child ``c_j`` is emitted with probability
``prod_{i<j}(1 - r_i/m_{i}) * r_j/m_j`` where ``m_j = 1 - r_1 - ... - r_{j-1}`` is the remaining
mass, which telescopes to ``r_j``; every other token ``t`` is emitted with probability
``m_{k+1} * r_t / m_{k+1} = r_t``. So each emitted token follows the target distribution given the
tokens before it, exactly as plain sampling would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.config import check_number
from specdec.tree import ROOT, TokenTree

GREEDY_TEMPERATURE = 0.0  # temperature at or below which decoding is greedy (argmax)


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is shaped before acceptance (HF order: T, top-k, top-p)."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept (1 = off)
    top_k: int = 0  # tokens kept (0 = off)

    def __post_init__(self) -> None:
        """Finite numbers in range, else ``ConfigError`` (a ValueError) naming the key, the value and the range."""
        rules = {
            "temperature": dict(kind=float, lo=0.0, hint="0 = greedy"),
            "top_p": dict(kind=float, above=0.0, hi=1.0, hint="1 = off"),
            "top_k": dict(kind=int, lo=0, hint="0 = off"),
        }
        for key, rule in rules.items():
            object.__setattr__(self, key, check_number(key, getattr(self, key), **rule))

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float64 probabilities after temperature, top-k and top-p.

    Greedy params give the one-hot argmax distribution.
    """
    logits = logits.to(torch.float64)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float64)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [..., V] mass of strictly better tokens
        drop_sorted = mass_before >= params.top_p  # keeps the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def accept_sampled(tree: TokenTree, probs: torch.Tensor, generator: torch.Generator) -> tuple[list[int], int]:
    """Lossless tree acceptance by sampling (rule in the module docstring).

    ``probs`` [n + 1, V] (CPU): target distribution after the root and after each node.
    Returns (accepted node indices from the top, the recovered or bonus token).
    """
    accepted: list[int] = []
    cur = ROOT
    table = probs.detach().to("cpu", torch.float64).numpy()  # [n + 1, V]
    while True:
        residual = table[cur + 1].copy()  # [V]
        chosen = None
        for child in tree.children(cur):
            tok = int(tree.tokens[child])
            mass = float(residual.sum())
            p_child = float(residual[tok]) / mass if mass > 0 else 0.0
            if p_child > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) < p_child:
                chosen = child
                break
            residual[tok] = 0.0
        if chosen is None:
            if float(residual.sum()) <= 0:  # only reachable through rounding: fall back to the full target
                residual = table[cur + 1].copy()
            weights = torch.from_numpy(residual / residual.sum())
            return accepted, int(torch.multinomial(weights, 1, generator=generator))
        accepted.append(chosen)
        cur = chosen


def accept_greedy(tree: TokenTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance: ``logits`` [n + 1, V] -> (accepted node indices, recovered or bonus token)."""
    target_next = logits.argmax(-1).cpu().numpy().astype(np.int64)  # [n + 1]
    return tree.accept_greedy(target_next)


def accept(
    tree: TokenTree, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[list[int], int]:
    """Acceptance by ``params``: greedy (argmax walk) or lossless sampling. ``logits`` [n + 1, V]."""
    if params.greedy:
        return accept_greedy(tree, logits)
    return accept_sampled(tree, target_probs(logits.cpu(), params), generator)
