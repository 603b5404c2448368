"""Trace records: one recorded (prompt, response) pair in token ids, and prompt-only records for live runs.

A ``TraceRecord`` is what trace replay consumes: the prompt the drafter sees first and the true response the
simulated verifier walks drafts against. Loaders store the ids as read-only ``np.ndarray`` int32 (an OpenHands
set holds ~29 M prompt tokens, far too many for Python lists); lists given by callers are converted. Use
``prompt_list()`` / ``response_list()`` when a plain list is needed (never ``prompt_ids + other``: numpy adds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ID_DTYPE = np.int32


def as_ids(values: Sequence[int] | np.ndarray, *, what: str = "ids") -> np.ndarray:
    """[n] int32 read-only copy/view of token ids; rejects negatives and non-integers."""
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, ID_DTYPE)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be a flat list of integer token ids, got dtype {arr.dtype} shape {arr.shape}")
    if arr.min() < 0 or arr.max() > np.iinfo(ID_DTYPE).max:
        raise ValueError(
            f"{what} holds token id {int(arr.min()) if arr.min() < 0 else int(arr.max())} "
            f"outside [0, {np.iinfo(ID_DTYPE).max}]"
        )
    out = np.ascontiguousarray(arr, dtype=ID_DTYPE)
    if out is arr:
        out = out.copy()
    out.flags.writeable = False
    return out


@dataclass
class TraceRecord:
    """One recorded request: ``prompt_ids`` [P] and ``response_ids`` [R] (int32 arrays after init).

    ``group`` ties records of one conversation or agent episode together (e.g. an OpenHands instance id);
    replay keeps the given order either way.
    """

    id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    group: str = ""

    def __post_init__(self) -> None:
        self.id = str(self.id)
        self.prompt_ids = as_ids(self.prompt_ids, what=f"record {self.id!r} prompt_ids")
        self.response_ids = as_ids(self.response_ids, what=f"record {self.id!r} response_ids")

    def prompt_list(self) -> list[int]:
        return self.prompt_ids.tolist()

    def response_list(self) -> list[int]:
        return self.response_ids.tolist()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TraceRecord):
            return NotImplemented
        return (
            self.id == other.id
            and self.group == other.group
            and np.array_equal(self.prompt_ids, other.prompt_ids)
            and np.array_equal(self.response_ids, other.response_ids)
        )


@dataclass
class PromptRecord:
    """A prompt-only item for live runs: ``prompt`` is text or chat ``messages`` (list of role/content dicts).

    ``turns`` holds later user turns of a multi-turn benchmark (MT-Bench); live runs use the first turn only
    unless asked otherwise. ``meta`` keeps source fields (category, task id) for reports.
    """

    id: str
    prompt: str | list[dict[str, Any]]
    turns: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)


def total_tokens(records: Sequence[TraceRecord]) -> tuple[int, int]:
    """(prompt tokens, response tokens) summed over ``records``."""
    return (sum(int(r.prompt_ids.size) for r in records), sum(int(r.response_ids.size) for r in records))
