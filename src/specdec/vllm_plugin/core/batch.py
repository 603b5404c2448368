"""``StepBatch``: one vLLM step's rows as the proposer receives them, the one type every drafting path takes.

vLLM hands a proposer a step as loose arrays; the proposer (``proposer.py``) wraps them once, and the core, the
modes and both drafting engines pass the batch on instead of writing the arrays out again. Never imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepBatch:
    """One step's rows (row i of every field is one request). The arrays are vLLM's own buffers, read in place:
    a row that must be kept past the step is copied (its buffer changes later)."""

    req_ids: Sequence[str]  # [>= rows] request id by row
    sampled: Sequence[Sequence[int]]  # [rows][new tokens] each row's new tokens (empty: a prefill without one)
    num_tokens: np.ndarray  # [>= rows] int32 context length after the new tokens
    token_ids: np.ndarray  # [>= rows, max_model_len] int32 each row's context
    num_prompt_tokens: np.ndarray | None = None  # [>= rows] prompt lengths (None: the context before the new tokens)
    k: int | None = None  # this step's draft length limit from vLLM (None: the proposer's own k)

    @property
    def rows(self) -> int:
        return len(self.sampled)

    def context(self, i: int) -> tuple[list[int], int]:
        """Row ``i``'s context (a copy) and its prompt length: what a restart of the request starts from."""
        n = int(self.num_tokens[i])
        p = n - len(self.sampled[i])
        if self.num_prompt_tokens is not None:
            p = max(1, min(int(self.num_prompt_tokens[i]), n))
        return np.asarray(self.token_ids[i, :n]).tolist(), p
