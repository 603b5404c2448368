"""Support for the numpy draft-model backend (``specdec.drafters.model_numpy``): OpenBLAS thread control,
the per-request KV state, small-row matrix products and the rotary column order."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

INITIAL_CAPACITY = 256  # KV slots of a new state; doubles when full
# Up to this many rows, ``rows @ W`` runs as one matrix-vector product per row: OpenBLAS's GEMM packs W first and
# is 2-3x slower than per-row products at 2 rows, even at 4 for the LM head (1 thread, AVX2).
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
