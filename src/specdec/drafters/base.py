"""The drafter interface: one request lifecycle keyed by request id.

    drafter.start(request_id, prompt_ids)        # a new request and its prompt
    drafter.extend(request_id, token_ids)        # tokens the verifier emitted (accepted + bonus)
    drafter.draft_batch([DraftRequest(...), ...]) -> list[TokenTree]   # one tree per request
    drafter.stop(request_id)                     # finished or aborted; frees per-request state

``draft(request_id, budget)`` is a one-request convenience over ``draft_batch``. A drafter never
returns more nodes than the request's budget, and returns ``TokenTree.empty()`` when it has nothing
to propose. This module (and all of ``specdec.drafters``) never imports vLLM.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from specdec.config import check_number
from specdec.tree import TokenTree, best_chain

T = TypeVar("T")
Chain = tuple[list[int], "list[float] | None"]  # (tokens [m], path probabilities [m] or None): a chain draft

logger = logging.getLogger("specdec.drafters")
BUDGET_HINT = "the most draft tokens for the request; 0 drafts nothing; round a fractional one with int()"


MAX_TOKEN_ID = 2**63 - 1  # every drafter takes token ids in [0, 2**63)
TEXT = (str, bytes, bytearray, memoryview)


def refuse_text(ids: object) -> None:
    """A TypeError for text or bytes given as token ids (each would otherwise iterate as ids or characters)."""
    if isinstance(ids, TEXT):
        raise TypeError(
            f"token ids must be a sequence of ints, not {type(ids).__name__} ({ids[:12]!r}...): tokenize text first, "
            "or pass list(data) for byte-level ids"
        )


def token_ids(ids: Sequence[int] | np.ndarray) -> list[int]:
    """``ids`` as a list of ints in [0, 2**63): text, bytes, floats and bools are refused (TypeError), negative or
    wider ids too (ValueError), as both suffix engines refuse them; ints of any width are kept, never truncated."""
    refuse_text(ids)
    if isinstance(ids, np.ndarray) and ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise TypeError(f"token ids must be integers in [0, 2**63); got an array of {ids.dtype}")
    out = ids.reshape(-1).tolist() if isinstance(ids, np.ndarray) else list(ids)
    for t in out:
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
            raise TypeError(f"token ids must be integers in [0, 2**63); got {t!r}")
        if not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"token ids must be integers in [0, 2**63); got {t!r}")
    return [int(t) for t in out]


@dataclass(frozen=True)
class DraftRequest:
    """One request's drafting order for one step."""

    request_id: str
    budget: int  # max draft tokens (tree nodes)
    tree: bool = False  # False: a chain is wanted (vLLM); True: any tree shape
    free: bool = False  # the verifier checks `budget` tokens whatever the draft holds (a padded batch): a drafter
    # may then draft further than where each verified token costs (suffix: free_spec_factor)

    def __post_init__(self) -> None:
        """The budget is an int >= 0 on every drafter (2.7 or True would be read differently by each backend)."""
        if type(self.budget) is not int or self.budget < 0:
            budget = check_number("budget", self.budget, kind=int, lo=0, hint=BUDGET_HINT)
            object.__setattr__(self, "budget", budget)


class Drafter(abc.ABC):
    """Base class of all drafters. Subclasses implement the five lifecycle methods."""

    name: str = "drafter"
    # options of ``config`` read at draft time and nowhere else: an evaluation may give the drafter a config that
    # differs from its own only in these between two drafts (``specdec-eval curve`` sweeps them in one replay)
    draft_options: frozenset[str] = frozenset()

    @abc.abstractmethod
    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        """Begin a request whose context is ``prompt_ids``."""

    @abc.abstractmethod
    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Append tokens emitted for the request (accepted draft tokens plus the bonus token)."""

    @abc.abstractmethod
    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        """Draft for many requests at once; one tree per request, in order."""

    @abc.abstractmethod
    def stop(self, request_id: str) -> None:
        """Forget the request (finished or aborted). Unknown ids are ignored."""

    def draft(self, request_id: str, budget: int, *, tree: bool = False) -> TokenTree:
        return self.draft_batch([DraftRequest(request_id, budget, tree)])[0]

    def draft_chains(self, requests: Sequence[DraftRequest]) -> list[Chain]:
        """Chain drafts as plain lists: per request ``(tokens [m], path probabilities [m] or None)``.

        The hot path of the vLLM proposer (which verifies chains only). Default: ``draft_batch`` reduced to each
        tree's most probable root path; drafters override it to skip building trees.
        """
        return [best_chain(t) for t in self.draft_batch(requests)]

    def draft_after(
        self, request_id: str, extra_tokens: Sequence[int], budget: int, *, tree: bool = False
    ) -> TokenTree | None:
        """Draft as if ``extra_tokens`` had been appended to the request's context, changing NO state.

        Used by ``specdec.pipeline.AsyncDrafter`` to pre-draft the next step for hypothetical outcomes
        of the step being verified ("hedges"). The request's state (and any global cache) must be
        exactly as before the call: nothing of ``extra_tokens`` may be learned. Calls are serialized
        with the other methods (never concurrent). Returns ``None`` when the drafter cannot do this
        (AsyncDrafter then drafts synchronously after ``extend``, as without it).

        Default: exact for ``extra_tokens == []`` (a plain draft, which changes no state) and ``None``
        otherwise. Drafters override it to hedge efficiently, e.g. by drafting from a read-only view
        of ``context + extra_tokens`` (a suffix tree matches the longer suffix without inserting it).
        """
        if len(extra_tokens) == 0:
            return self.draft_batch([DraftRequest(request_id, budget, tree)])[0]
        return None

    def active_requests(self) -> list[str]:
        """Ids of the requests with live state (for bookkeeping checks)."""
        return []

    def check_target(self, *, vocab_size: int, tokenizer_dir: str | None = None) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Raise ``ConfigError`` when this drafter cannot draft for a target of ``vocab_size`` tokens whose
        tokenizer is in ``tokenizer_dir`` (None: unknown). Model-free drafters draft ids seen in the context:
        any target suits them."""

    def memory_bytes(self) -> int:
        """Approximate bytes held by drafter state (0 if unknown)."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release threads, sessions or other resources."""


class WrappedDrafter(Drafter):
    """A drafter around ``inner``: its lifecycle (start, extend, stop, close) and introspection (active requests,
    memory, target check) are the inner drafter's; a subclass drafts (``draft_batch``) with what it adds."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.name = inner.name

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        self.inner.start(request_id, prompt_ids)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.inner.extend(request_id, token_ids)

    def stop(self, request_id: str) -> None:
        self.inner.stop(request_id)

    def active_requests(self) -> list[str]:
        return self.inner.active_requests()

    def check_target(self, *, vocab_size: int, tokenizer_dir: str | None = None) -> None:
        self.inner.check_target(vocab_size=vocab_size, tokenizer_dir=tokenizer_dir)

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def close(self) -> None:
        self.inner.close()


def _is_tree(draft: object) -> bool:
    return isinstance(draft, TokenTree)


def _is_chain(draft: object) -> bool:
    return isinstance(draft, tuple) and len(draft) == 2 and hasattr(draft[0], "__len__")


@dataclass
class GuardStats:
    """Counters of drafting failures that were absorbed (the step went on without a draft)."""

    errors: int = 0
    timeouts: int = 0
    draft_seconds: float = 0.0
    _logged: set[str] = field(default_factory=set, repr=False)

    def as_dict(self) -> dict[str, float]:
        return {"draft_errors": self.errors, "draft_timeouts": self.timeouts, "draft_seconds": self.draft_seconds}


class DraftGuard:
    """Runs a drafter so that its failure never fails a request.

    On an exception every request of the call gets an empty draft for this step; the failure is counted
    and logged once per kind of error (with the request ids). ``strict=True`` re-raises instead, for
    debugging. Drafts longer than the budget are truncated (a drafter bug must not break the verifier).
    """

    def __init__(self, drafter: Drafter, *, strict: bool = False) -> None:
        self.drafter = drafter
        self.strict = strict
        self.stats = GuardStats()

    def draft_chains(self, requests: Sequence[DraftRequest]) -> list[Chain]:
        """``Drafter.draft_chains`` with the same failure handling as ``draft_batch``; chains cut to budget."""
        chains = self._guarded(self.drafter.draft_chains, requests, ([], None), _is_chain)
        return [
            (toks[: r.budget], probs[: r.budget] if probs is not None else None)
            if len(toks) > r.budget
            else (toks, probs)
            for (toks, probs), r in zip(chains, requests)
        ]

    def draft_batch(self, requests: Sequence[DraftRequest]) -> list[TokenTree]:
        trees = self._guarded(self.drafter.draft_batch, requests, TokenTree.empty(), _is_tree)
        return [t.truncate(r.budget) for t, r in zip(trees, requests)]

    def _guarded(
        self,
        fn: Callable[[Sequence[DraftRequest]], list[T]],
        requests: Sequence[DraftRequest],
        empty: T,
        valid: Callable[[object], bool],
    ) -> list[T]:
        """``fn(requests)``, timed; a failure or a wrong count gives ``empty`` for every request, a draft that is
        not ``valid`` (e.g. None) ``empty`` for its request (counted, logged once per error type; re-raised with
        ``strict``)."""
        t0 = time.perf_counter()
        try:
            out = fn(requests)
            if out is None or len(out) != len(requests):
                got = "None" if out is None else f"{len(out)} drafts"
                raise RuntimeError(f"{self.drafter.name} returned {got} for {len(requests)} requests")
            out = list(out)
            for i, (draft, req) in enumerate(zip(out, requests)):
                if not valid(draft):
                    err = TypeError(
                        f"{self.drafter.name} returned {type(draft).__name__} for request "
                        f"{req.request_id!r}; expected a draft (an empty one for no draft)"
                    )
                    if self.strict:
                        raise err
                    self.record_error(err, [req.request_id])
                    out[i] = empty
            return out
        except Exception as exc:  # noqa: BLE001 - any drafter failure degrades to "no draft"
            if self.strict:
                raise
            self.record_error(exc, [r.request_id for r in requests])
            return [empty for _ in requests]
        finally:
            self.stats.draft_seconds += time.perf_counter() - t0

    def call(self, method: str, request_id: str, *args: object) -> None:
        """Run a lifecycle method (start/extend/stop), absorbing failures like ``draft_batch``."""
        try:
            getattr(self.drafter, method)(request_id, *args)
        except Exception as exc:  # noqa: BLE001
            if self.strict:
                raise
            self.record_error(exc, [request_id])

    def record_error(self, exc: BaseException, request_ids: list[str]) -> None:
        self.stats.errors += 1
        key = f"{type(exc).__name__}"
        if key not in self.stats._logged:
            self.stats._logged.add(key)
            logger.warning(
                "drafter %s failed for request(s) %s: %r; those requests go on without a draft "
                "(counted as draft_errors; further %s errors are not logged)",
                self.drafter.name,
                ", ".join(request_ids[:8]),
                exc,
                key,
            )
