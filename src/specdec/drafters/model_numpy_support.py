"""Support for the numpy draft-model backend (``specdec.drafters.model_numpy``): OpenBLAS thread control,
the per-request KV state, a batched forward's inputs as one batch and their attention biases, small-row matrix
products and the rotary column order."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from specdec.drafters.model_backends import StepInput

INITIAL_CAPACITY = 256  # KV slots of a new state; doubles when full
# Up to this many rows, ``rows @ W`` runs as one matrix-vector product per row: OpenBLAS's GEMM packs W first,
# which costs more than per-row products at a few rows, and one row more for the LM head's wide W.
GEMV_ROWS = 3
GEMV_ROWS_HEAD = 4
F32 = np.float32


class _Unstable(Exception):
    """exp() of the attention scores over- or underflowed; the forward reruns with the stable softmax."""


# ------------------------------------------------------------------ BLAS threads
class _BlasThreads:
    """Get/set the thread count of the OpenBLAS that numpy loaded (no-op when there is none)."""

    _SYMBOLS = (
        ("scipy_openblas_get_num_threads64_", "scipy_openblas_set_num_threads64_"),
        ("scipy_openblas_get_num_threads", "scipy_openblas_set_num_threads"),
        ("openblas_get_num_threads64_", "openblas_set_num_threads64_"),
        ("openblas_get_num_threads", "openblas_set_num_threads"),
    )

    def __init__(self) -> None:
        self.get: Callable[[], int] | None = None
        self.set: Callable[[int], None] | None = None
        self.library = ""
        for lib_path in self._loaded_openblas():
            try:
                lib = ctypes.CDLL(lib_path)
            except OSError:
                continue
            for get_name, set_name in self._SYMBOLS:
                if hasattr(lib, get_name) and hasattr(lib, set_name):
                    get_fn, set_fn = getattr(lib, get_name), getattr(lib, set_name)
                    get_fn.restype, get_fn.argtypes = ctypes.c_int, []
                    set_fn.restype, set_fn.argtypes = None, [ctypes.c_int]
                    self.get, self.set, self.library = get_fn, set_fn, lib_path
                    return

    @staticmethod
    def _loaded_openblas() -> list[str]:
        """OpenBLAS libraries mapped into this process, numpy's own first."""
        try:
            with open("/proc/self/maps", encoding="utf-8") as fh:
                paths = {line.split()[-1] for line in fh if "openblas" in line.lower() and "/" in line}
        except OSError:  # not Linux
            return []
        site = os.path.dirname(os.path.dirname(np.__file__))
        return sorted(paths, key=lambda p: (not p.startswith(site), p))

    @property
    def available(self) -> bool:
        return self.set is not None


_BLAS: _BlasThreads | None = None


def blas_threads() -> _BlasThreads:
    global _BLAS
    if _BLAS is None:
        _BLAS = _BlasThreads()
    return _BLAS


def blas_name() -> str:
    """numpy's BLAS as its build config names it (e.g. 'scipy-openblas 0.3.31')."""
    try:
        cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]  # type: ignore[call-arg]
        return f"{cfg.get('name', '?')} {cfg.get('version', '')}".strip()
    except Exception:  # noqa: BLE001 - older numpy: no dict mode
        return "unknown"


# ------------------------------------------------------------------ per-request state
@dataclass(eq=False)  # states compare by identity
class NumpyState:
    """One request's KV cache ``kv`` ``[layers, capacity, 2, kv_heads, head_dim]``; slots ``< length`` valid.

    ``rows[l]`` ``[capacity, 2*kv_heads*head_dim]`` (a token's k|v), ``kt[l]`` ``[kv_heads, head_dim, capacity]``
    and ``vs[l]`` ``[kv_heads, capacity, head_dim]`` are views of ``kv``, rebuilt when it grows.
    """

    kv: np.ndarray
    length: int = 0
    rows: list = field(default_factory=list)
    kt: list = field(default_factory=list)
    vs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self._views()

    def _views(self) -> None:
        L, cap = self.kv.shape[:2]
        self.rows = [self.kv[li].reshape(cap, -1) for li in range(L)]
        self.kt = [self.kv[li, :, 0].transpose(1, 2, 0) for li in range(L)]
        self.vs = [self.kv[li, :, 1].transpose(1, 0, 2) for li in range(L)]

    @property
    def capacity(self) -> int:
        return self.kv.shape[1]

    def reserve(self, need: int) -> None:
        """Room for ``need`` slots (capacity doubles; filled slots are kept)."""
        cap = self.capacity
        if need <= cap:
            return
        if cap == 0:
            raise ValueError("forward on a released state (call new_state() for a new request)")
        while cap < need:
            cap *= 2
        new = np.empty((self.kv.shape[0], cap) + self.kv.shape[2:], F32)
        new[:, : self.length] = self.kv[:, : self.length]
        self.kv = new
        self._views()


# ------------------------------------------------------------------ a forward's inputs
class Batch(NamedTuple):
    """The new tokens of a batched forward's items, laid out item after item as the rows of one matrix."""

    tokens: list[int]  # [N] every item's new tokens
    positions: list[int]  # [N] their rotary positions
    spans: list[tuple[int, int, int]]  # per item: (first row, new tokens, cached tokens before them)
    biases: list[np.ndarray | None]  # per item: its attention bias (``attention_bias``)
    want: list[int]  # rows whose logits are returned


def gather_batch(items: Sequence[StepInput]) -> Batch:
    """Check every item (one position per token, ``want`` within its new tokens), make room in its state for them and
    lay all items' new tokens out as one ``Batch``."""
    spans, biases, want = [], [], []
    tokens: list[int] = []
    positions: list[int] = []
    for it in items:
        n, start = len(it.tokens), it.state.length
        if n == 0 or len(it.positions) != n:
            raise ValueError(
                f"StepInput needs >= 1 token and one position per token (got {n} tokens, {len(it.positions)} positions)"
            )
        if any(not 0 <= int(j) < n for j in it.want):
            raise ValueError(f"StepInput.want={list(it.want)!r} must index the item's {n} new tokens")
        it.state.reserve(start + n)
        biases.append(attention_bias(it, start, n))
        want.extend(len(tokens) + int(j) for j in it.want)
        spans.append((len(tokens), n, start))
        tokens.extend(it.tokens)
        positions.extend(it.positions)
    return Batch(tokens, positions, spans, biases, want)


def attention_bias(it: StepInput, start: int, n: int) -> np.ndarray | None:
    """Additive attention bias ``[n, start + n]`` (0 = may attend, -inf = not) or None for one causal token."""
    if it.mask is None:
        if n == 1:
            return None
        bias = np.zeros((n, start + n), F32)
        bias[:, start:][np.triu_indices(n, 1)] = -np.inf
        return bias
    mask = np.asarray(it.mask, dtype=bool)
    if mask.shape != (n, start + n):
        raise ValueError(f"StepInput.mask has shape {mask.shape}; expected [n, cached + n] = {(n, start + n)}")
    return np.where(mask, F32(0.0), F32(-np.inf))


def _matmul(a: np.ndarray, w: np.ndarray, out: np.ndarray, rows: int = GEMV_ROWS) -> None:
    """``out = a @ w``; with few rows as one matrix-vector product per row (see ``GEMV_ROWS``)."""
    if a.shape[0] <= rows:
        for i in range(a.shape[0]):
            np.matmul(a[i], w, out=out[i])
    else:
        np.matmul(a, w, out=out)


def _interleave_rotary(hd: int) -> np.ndarray:
    """Column order within a head that puts rotary pairs ``(i, i + hd/2)`` side by side."""
    half = hd // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)  # [0, h, 1, h+1, ...]
