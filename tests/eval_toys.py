"""Small drafters for the eval tests (registered into the drafter registry by the tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specdec.config import ConfigBase, rng
from specdec.drafters.base import Drafter, DraftRequest
from specdec.tree import TokenTree


@dataclass(frozen=True)
class LookupConfig(ConfigBase):
    max_n: int = rng(4, lo=1, hi=16, doc="longest n-gram matched")
    min_n: int = rng(2, lo=1, hi=16, doc="shortest n-gram matched")


class LookupDrafter(Drafter):
    """Prompt lookup: the earliest earlier occurrence of the longest suffix n-gram (vLLM's rule)."""

    name = "toy-lookup"
    Config = LookupConfig

    def __init__(self, config: LookupConfig | None = None) -> None:
        self.config = config or LookupConfig()
        self.ctx: dict[str, list[int]] = {}

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.ctx[request_id] = list(prompt_ids)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.ctx[request_id].extend(int(t) for t in token_ids)

    def stop(self, request_id: str) -> None:
        self.ctx.pop(request_id, None)

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        return [self._one(self.ctx[r.request_id], r.budget) for r in requests]

    def _one(self, ctx: list[int], budget: int) -> TokenTree:
        seq = np.asarray(ctx, dtype=np.int64)
        L = seq.size
        for n in range(self.config.max_n, self.config.min_n - 1, -1):
            if n + 1 > L:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)
            hits = np.flatnonzero((windows == seq[L - n :]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return TokenTree.chain(seq[start : min(start + budget, L)])
        return TokenTree.empty()


@dataclass(frozen=True)
class NothingConfig(ConfigBase):
    pass


class NothingDrafter(Drafter):
    """Never drafts (MAT 1.0)."""

    name = "toy-nothing"
    Config = NothingConfig

    def __init__(self, config: NothingConfig | None = None) -> None:
        self.config = config

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def stop(self, request_id: str) -> None: ...

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        return [TokenTree.empty() for _ in requests]
