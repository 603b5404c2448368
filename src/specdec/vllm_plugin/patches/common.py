"""What every vLLM patch shares: the marker of a wrapped method, how our proposer is recognised, source checks.

A patch never imports the proposer (it would close an import cycle through ``patches.table``): the proposer class
carries ``PROPOSER_MARK`` and a runner's drafter is ours when its class has it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from specdec.vllm_plugin.attrs import PATCHES, PROPOSER_MARK, WRAPPED


def is_wrapped(fn: Any, name: str) -> bool:
    """``fn`` is (or wraps) the wrapper of patch ``name``: idempotent patches, and what ``patches.table`` reports."""
    return name in getattr(fn, PATCHES, ())


def mark(fn: Any, name: str) -> Any:
    """Mark ``fn`` as patch ``name``'s wrapper and return it."""
    setattr(fn, WRAPPED, True)
    setattr(fn, PATCHES, frozenset(getattr(fn, PATCHES, ())) | {name})
    return fn


def wrap_method(
    cls: Any,
    attr: str,
    name: str,
    make: Callable[[Any], Callable[..., Any]],
    *,
    problem: Callable[[Any], str] | None = None,
    static: bool = False,
) -> bool:
    """The one apply-and-mark of every patch: unless ``problem(cls)`` names a reason it does not fit, replace
    ``cls.attr`` by ``make(original)`` (with the original's name and docstring), marked as patch ``name``;
    ``static``: the method is a staticmethod and stays one. Idempotent. Returns True if the method is (now) wrapped."""
    if problem is not None and problem(cls):
        return False
    orig = getattr(cls, attr)
    if is_wrapped(orig, name):
        return True
    fn = mark(functools.wraps(orig)(make(orig)), name)
    setattr(cls, attr, staticmethod(fn) if static else fn)
    return True


def is_ours(drafter: Any) -> bool:
    """``drafter`` (a runner's ``drafter``) is a specdec proposer."""
    return bool(getattr(type(drafter), PROPOSER_MARK, False))


def source_has(fn: Any, text: str) -> bool:
    """Whether ``fn``'s source contains ``text`` (False when the source cannot be read): the version check of a
    patch written against that code."""
    try:
        return text in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def sources_problem(cls: Any, wanted: dict[str, str]) -> str:
    """'' if the source of every method of ``cls`` in ``wanted`` contains the given text, else the reason."""
    for name, text in wanted.items():
        if not source_has(getattr(cls, name, None), text):
            return f"{getattr(cls, '__name__', cls)}.{name} is not the one this patch was written for"
    return ""


def leading_params(fn: Any) -> list[str]:
    """The parameter names of ``fn`` ([] when it has no signature)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def signature_problem(cls: Any, wanted: dict[str, list[str]]) -> str:
    """'' if every method of ``cls`` in ``wanted`` exists and starts with the given parameters, else the reason."""
    for name, lead in wanted.items():
        fn = getattr(cls, name, None)
        if fn is None:
            return f"{getattr(cls, '__name__', cls)}.{name} is missing"
        params = leading_params(fn)
        if params[: len(lead)] != lead:
            return f"{getattr(cls, '__name__', cls)}.{name}{params} has an unexpected signature"
    return ""
