"""The draft model's Llama forward in plain numpy: few, allocation-free ops per decode step (backend ``numpy``).

At batch 1 a 7M-parameter draft model does ~14 MFLOP per token; torch and ONNX Runtime spend most of a
step dispatching ops. Here a decode step is ~21 numpy calls per layer on preallocated buffers, with as much
as possible folded into the weights at load time (same math as ``specdec.drafters.model_llama``):

* RMSNorm weights are folded into the rows of the next matrix (``qkv``, ``gate|up``, the LM head), so a norm
  is one per-row scale of the input;
* q, k, v come from one matmul, gate and up from another; the attention scale ``1/sqrt(head_dim)`` is folded
  into the q columns;
* rotary embedding is one in-place complex multiply: the q/k columns of every head are reordered so that the
  pairs ``(x[i], x[i + hd/2])`` that rotary mixes sit side by side, viewed as complex64 and multiplied by
  ``exp(i * pos * freq)``. q and k share the order, so their dot products (attention) are unchanged;
* a new token's ``k|v`` (already rotated) is one contiguous row of the ``qkv`` output and one row of the
  cache, so appending to the cache is one copy for all layers' heads of that token;
* softmax is ``exp`` then one division of the (small) attention output by the row sums, without subtracting
  the row maximum first. The row sums are checked: a score above ~88 overflows float32 and scores all below
  ~-46 lose precision, and then the forward reruns with the max-subtracting softmax (not seen with the
  trained draft model; exercised by the tests);
* SwiGLU as ``u / (1 + exp(-g)) * (-g)`` with the gate columns stored negated and the down projection
  negated back (4 elementwise ops, no temporaries).

Each request's KV cache is one array ``[layers, capacity, 2 (k|v), kv_heads, head_dim]`` that grows by
doubling. A ``forward`` runs norms, projections, MLP and the LM head as one matrix over the new tokens of all
items, and attention per item (own cache, optional tree mask). Grouped-query attention puts the query heads of
a kv head in the rows of one product with that head's cache. The LM head runs only on the wanted rows.

BLAS threads: the forward runs OpenBLAS (numpy's usual BLAS) single-threaded, then restores its previous
setting. The per-layer products are too small to gain from a second thread, and OpenBLAS worker threads
busy-wait for a long while after a threaded call: the torch ops the drafter runs right after a forward
(log-softmax, top-k on OpenMP threads) then fight them for the cores (measured on 2 cores: 8 ms instead of
1.7 ms per step with a 2-thread LM head). ``threads`` > 1 opts in for the LM head anyway (standalone use).

Where the time goes (code-draft-7m, 2-core AVX2 EPYC, 1 thread, context 256): a decode step is ~1.2 ms, of
which ~0.15 ms is numpy call overhead (same step on a 4-layer model with tiny matrices) and the rest streaming
the 29 MB of fp32 weights (16 MB of them the LM head) from memory at ~25-40 GB/s. numpy has no bf16/int8
products that would cut those bytes. Batches run single-threaded too, so backends using both cores (ONNX
Runtime) win from batch 2 on there; see benchmarks/bench_draft_cpu.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from specdec.drafters.model_backends import DraftBackend, StepInput
from specdec.drafters.model_llama import LlamaShape, load_safetensors
from specdec.drafters.model_numpy_support import (  # noqa: F401 - INITIAL_CAPACITY, blas_* are re-exported
    F32,
    GEMV_ROWS,
    GEMV_ROWS_HEAD,
    INITIAL_CAPACITY,
    NumpyState,
    _interleave_rotary,
    _matmul,
    _Unstable,
    attention_bias,
    blas_name,
    blas_threads,
    gather_batch,
)

# softmax row sums outside (SUM_MIN, inf) mean exp() over- or underflowed (scores above ~88 or all below ~-46):
# rerun with the max-subtracting softmax
SUM_MIN = 1e-20


class NumpyLlamaBackend(DraftBackend):
    """The Llama forward of ``LlamaCore`` in numpy (see the module docstring)."""

    name = "numpy"

    def __init__(self, path: str | Path, *, threads: int = 1) -> None:
        path = Path(path)
        s = LlamaShape.load(path)
        if s.heads % s.kv_heads or s.head_dim % 2:
            raise ValueError(
                f"{path}: heads={s.heads} must be a multiple of kv_heads={s.kv_heads} and head_dim={s.head_dim} even"
            )
        self.shape = s
        self.vocab_size, self.max_positions = s.vocab, s.max_positions
        self.threads = max(1, int(threads))
        self._blas = blas_threads()
        self.stable_reruns = 0  # forwards rerun with the max-subtracting softmax (overflow seen)
        self._load(path)
        self._rows = 0
        self._scratch(8)

    # ------------------------------------------------------------------ weights
    def _load(self, path: Path) -> None:
        s = self.shape
        raw = load_safetensors(path)
        get = lambda k: raw[k].to(torch.float64).numpy()  # noqa: E731 - fold in float64, round once to fp32
        f32 = lambda a: np.ascontiguousarray(a, dtype=F32)  # noqa: E731
        H, KVH, hd = s.heads, s.kv_heads, s.head_dim
        perm = _interleave_rotary(hd)
        embed = get("model.embed_tokens.weight")  # [V, d]
        head = embed if s.tied or "lm_head.weight" not in raw else get("lm_head.weight")  # [V, d]
        self.embed = f32(embed)
        self.lm_head = f32(get("model.norm.weight")[:, None] * head.T)  # [d, V], final norm folded in
        self.qkv, self.o, self.gate_up, self.down = [], [], [], []
        for i in range(s.layers):
            p = f"model.layers.{i}."
            q = get(p + "self_attn.q_proj.weight").reshape(H, hd, -1)[:, perm] / math.sqrt(hd)
            k = get(p + "self_attn.k_proj.weight").reshape(KVH, hd, -1)[:, perm]
            v = get(p + "self_attn.v_proj.weight")
            qkv = np.concatenate([q.reshape(H * hd, -1), k.reshape(KVH * hd, -1), v])  # [(H+2KVH)*hd, d]
            self.qkv.append(f32(get(p + "input_layernorm.weight")[:, None] * qkv.T))  # [d, (H+2KVH)*hd]
            self.o.append(f32(get(p + "self_attn.o_proj.weight").T))  # [H*hd, d]
            gu = np.concatenate([-get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])  # [2I, d]
            self.gate_up.append(f32(get(p + "post_attention_layernorm.weight")[:, None] * gu.T))  # [d, 2I]
            self.down.append(f32(-get(p + "mlp.down_proj.weight").T))  # [I, d]
        # rotary angles exactly as LlamaCore computes them (fp32), as unit complex numbers per (position, pair)
        exponents = torch.arange(0, hd, 2, dtype=torch.int64).float() / hd
        inv = 1.0 / (s.rope_theta**exponents)  # [hd/2]
        ang = torch.arange(s.max_positions, dtype=torch.float32)[:, None] * inv[None]  # [P, hd/2]
        rot = np.empty((s.max_positions, hd // 2), np.complex64)
        rot.real, rot.imag = ang.cos().numpy(), ang.sin().numpy()
        self.rot = rot  # [P, hd/2]

    def _scratch(self, rows: int) -> None:
        """(Re)allocate the per-token buffers for ``rows`` tokens per forward, and their fixed views."""
        if rows <= self._rows:
            return
        s = self.shape
        rows = max(rows, 2 * self._rows)
        H, KVH, hd, d, inter = s.heads, s.kv_heads, s.head_dim, s.hidden, s.intermediate
        self._rows = rows
        self._x = np.empty((rows, d), F32)  # residual stream
        self._h = np.empty((rows, d), F32)  # normed input of a projection
        self._t = np.empty((rows, d), F32)  # output of o / down before the residual add
        self._qkv = np.empty((rows, (H + 2 * KVH) * hd), F32)  # q | k | v, q and k rotated in place
        self._att = np.empty((rows, H * hd), F32)  # attention output, heads concatenated
        self._gu = np.empty((rows, 2 * inter), F32)
        self._act = np.empty((rows, inter), F32)
        # single-token views (row 0)
        self._q1 = self._qkv[0, : H * hd].reshape(KVH, H // KVH, hd)
        self._qk1 = self._qkv[0, : (H + KVH) * hd].view(np.complex64).reshape(H + KVH, hd // 2)
        self._kv1 = self._qkv[0, H * hd :]
        self._att1 = self._att[0].reshape(KVH, H // KVH, hd)
        self._sums = np.empty((s.layers, KVH, H // KVH, 1), F32)  # softmax row sums of a decode step

    # ------------------------------------------------------------------ states
    def new_state(self) -> NumpyState:
        s = self.shape
        return NumpyState(np.empty((s.layers, INITIAL_CAPACITY, 2, s.kv_heads, s.head_dim), F32))

    def length(self, state: NumpyState) -> int:
        return state.length

    def crop(self, state: NumpyState, n: int) -> None:
        state.length = max(0, min(state.length, n))

    def release(self, state: NumpyState) -> None:
        state.kv = np.empty((0, 0, 2, 0, 0), F32)
        state.length = 0
        state.rows, state.kt, state.vs = [], [], []

    def state_bytes(self, state: NumpyState) -> int:
        s = self.shape
        return 2 * s.layers * s.kv_heads * state.length * s.head_dim * 4

    def describe(self) -> str:
        return (
            f"numpy ({blas_name()}, {self.threads} LM-head BLAS thread(s)"
            f"{'' if self._blas.available else ', thread count not controllable'})"
        )

    # ------------------------------------------------------------------ forward
    def forward(self, items: Sequence[StepInput]) -> list[torch.Tensor]:
        if not items:
            return []
        blas = self._blas
        prev = blas.get() if blas.available else 0
        try:
            if blas.available and prev != 1:
                blas.set(1)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                stable = False
                first = items[0]
                if len(items) == 1 and len(first.tokens) == 1 and (not len(first.want) or list(first.want) == [0]):
                    out = self._decode1(items[0])
                    if out is not None:
                        items[0].state.length += 1
                        return [out]
                    stable = True  # a score overflowed exp(): rerun with the stable softmax
                else:
                    try:
                        x, want = self._forward(items, stable=False)
                        stable = not np.isfinite(x).all()
                    except _Unstable:
                        stable = True
                if stable:
                    self.stable_reruns += 1
                    x, want = self._forward(items, stable=True)
                for it in items:
                    it.state.length += len(it.tokens)
                return self._logits(x, want, [len(it.want) for it in items])
        finally:
            if blas.available and blas.get() != prev:
                blas.set(prev)

    def _decode1(self, it: StepInput) -> torch.Tensor | None:
        """One request, one new token, at most one wanted row; None when exp() over/underflowed (rerun)."""
        s = self.shape
        x0 = self._forward1(it)
        ss = float(np.dot(x0, x0))
        sums = self._sums
        if not (math.isfinite(ss) and sums.min() > SUM_MIN and sums.max() < np.inf):
            return None
        logits = np.empty((len(it.want), s.vocab), F32)
        if len(it.want):
            h0 = self._h[0]
            np.multiply(x0, 1.0 / math.sqrt(ss / s.hidden + s.eps), out=h0)
            if self.threads > 1 and self._blas.available:
                self._blas.set(self.threads)
            np.matmul(h0, self.lm_head, out=logits[0])
        return torch.from_numpy(logits)

    def _forward1(self, it: StepInput) -> np.ndarray:
        """One request, one new token: the decode step, as few numpy calls as the math allows."""
        s = self.shape
        st: NumpyState = it.state
        start = st.length
        S = start + 1
        st.reserve(S)
        bias = attention_bias(it, start, 1)
        inv_d, eps = 1.0 / s.hidden, s.eps
        x, h, t, qkv, att = self._x[:1], self._h[:1], self._t[:1], self._qkv[:1], self._att[:1]
        gu, act = self._gu[:1], self._act[:1]
        g, u = gu[:, : s.intermediate], gu[:, s.intermediate :]
        q1, qk1, kv1, att1 = self._q1, self._qk1, self._kv1, self._att1
        x0 = x[0]
        np.copyto(x0, self.embed[int(it.tokens[0])])
        rot = self.rot[int(it.positions[0])]  # [hd/2], broadcast over the q and k heads
        matmul, multiply, exp, dot, sqrt = np.matmul, np.multiply, np.exp, np.dot, math.sqrt
        add_reduce, sums = np.add.reduce, self._sums
        for li in range(s.layers):
            multiply(x, 1.0 / sqrt(float(dot(x0, x0)) * inv_d + eps), out=h)
            matmul(h, self.qkv[li], out=qkv)
            multiply(qk1, rot, out=qk1)  # rotary on q and k, in place
            st.rows[li][start] = kv1
            sc = matmul(q1, st.kt[li][:, :, :S])  # [KVH, G, S]
            if bias is not None:
                sc += bias
            exp(sc, out=sc)
            matmul(sc, st.vs[li][:, :S], out=att1)
            att1 /= add_reduce(sc, axis=2, keepdims=True, out=sums[li])
            matmul(att, self.o[li], out=t)
            x += t
            multiply(x, 1.0 / sqrt(float(dot(x0, x0)) * inv_d + eps), out=h)
            matmul(h, self.gate_up[li], out=gu)
            exp(g, out=act)  # gate columns are stored negated: exp(-gate)
            act += 1.0
            np.divide(u, act, out=act)
            act *= g  # = -silu(gate) * up; the down projection is stored negated
            matmul(act, self.down[li], out=t)
            x += t
        return x0

    def _forward(self, items: Sequence[StepInput], *, stable: bool) -> tuple[np.ndarray, list[int]]:
        """Any batch: the token-parallel parts over all new tokens as one matrix, attention per item."""
        s = self.shape
        H, KVH, hd = s.heads, s.kv_heads, s.head_dim
        half, QK = hd // 2, (H + KVH) * hd
        batch = gather_batch(items)
        spans, biases, want = batch.spans, batch.biases, batch.want
        N = len(batch.tokens)
        self._scratch(N)
        inv_d, eps = 1.0 / s.hidden, s.eps
        x, h, t, qkv, att = self._x[:N], self._h[:N], self._t[:N], self._qkv[:N], self._att[:N]
        gu, act = self._gu[:N], self._act[:N]
        g, u = gu[:, : s.intermediate], gu[:, s.intermediate :]
        np.take(self.embed, np.asarray(batch.tokens, np.intp), axis=0, out=x)
        rot = self.rot[np.asarray(batch.positions, np.intp)][:, None, :]  # [N, 1, hd/2]
        qk_c = qkv[:, :QK].view(np.complex64).reshape(N, H + KVH, half)  # rotary pairs as complex numbers
        q_heads = qkv[:, : H * hd].reshape(N, H, hd)
        kv_rows = qkv[:, H * hd :]
        mm = _matmul if N <= GEMV_ROWS else np.matmul
        for li in range(s.layers):
            self._norm(x, h, inv_d, eps)
            mm(h, self.qkv[li], qkv)
            np.multiply(qk_c, rot, out=qk_c)
            for (a, n, start), bias, it in zip(spans, biases, items):
                st = it.state
                st.rows[li][start : start + n] = kv_rows[a : a + n]
                self._attend(
                    q_heads[a : a + n],
                    st.kt[li][:, :, : start + n],
                    st.vs[li][:, : start + n],
                    bias,
                    att[a : a + n],
                    stable,
                )
            mm(att, self.o[li], t)
            x += t
            self._norm(x, h, inv_d, eps)
            mm(h, self.gate_up[li], gu)
            np.exp(g, out=act)
            act += 1.0
            np.divide(u, act, out=act)
            act *= g
            mm(act, self.down[li], t)
            x += t
        return x, want

    @staticmethod
    def _norm(x: np.ndarray, out: np.ndarray, inv_d: float, eps: float) -> None:
        """``out = x / rms(x)`` per row (the norm's weight is folded into the next matrix)."""
        ss = np.einsum("ij,ij->i", x, x)  # [N]
        ss *= inv_d
        ss += eps
        np.sqrt(ss, out=ss)
        np.divide(x, ss[:, None], out=out)

    def _attend(
        self, q: np.ndarray, kt: np.ndarray, v: np.ndarray, bias: np.ndarray | None, out: np.ndarray, stable: bool
    ) -> None:
        """One item's attention: q ``[n, H, hd]`` (scaled, rotated), kt ``[KVH, hd, S]``, v ``[KVH, S, hd]``.

        The ``G`` query heads of a kv head are rows of one product with its cache, rows ordered (token, head).
        ``bias`` ``[n, S]`` (0 / -inf) or None (attend to every slot: a single causal token). ``out`` ``[n, H*hd]``.
        """
        n, H, hd = q.shape
        KVH = kt.shape[0]
        G = H // KVH
        if n == 1:  # one token: its heads are one contiguous row, already in (kv head, group) order
            sc = np.matmul(q.reshape(KVH, G, hd), kt)  # [KVH, G, S]
            if bias is not None:
                sc += bias
            if stable:
                sc -= sc.max(axis=-1, keepdims=True)
            np.exp(sc, out=sc)
            total = np.add.reduce(sc, axis=-1, keepdims=True)
            self._check(total, stable)
            o = out.reshape(KVH, G, hd)
            np.matmul(sc, v, out=o)
            o /= total
            return
        qg = np.ascontiguousarray(q.reshape(n, KVH, G, hd).transpose(1, 0, 2, 3)).reshape(KVH, n * G, hd)
        sc = np.matmul(qg, kt)  # [KVH, n*G, S]
        if bias is not None:
            sc.reshape(KVH, n, G, -1)[...] += bias[:, None, :]
        if stable:
            sc -= sc.max(axis=-1, keepdims=True)
        np.exp(sc, out=sc)
        total = np.add.reduce(sc, axis=-1, keepdims=True)  # [KVH, n*G, 1]
        self._check(total, stable)
        o = np.matmul(sc, v)  # [KVH, n*G, hd]
        np.divide(
            o.reshape(KVH, n, G, hd).transpose(1, 0, 2, 3),
            total.reshape(KVH, n, G, 1).transpose(1, 0, 2, 3),
            out=out.reshape(n, KVH, G, hd),
        )

    @staticmethod
    def _check(total: np.ndarray, stable: bool) -> None:
        if not stable and not (total.min() > SUM_MIN and total.max() < np.inf):
            raise _Unstable

    def _logits(self, x: np.ndarray, want: list[int], counts: list[int]) -> list[torch.Tensor]:
        s = self.shape
        W = len(want)
        logits = np.empty((W, s.vocab), F32)
        if W:
            rows = x[np.asarray(want, np.intp)]  # [W, d] (a copy)
            self._norm(rows, rows, 1.0 / s.hidden, s.eps)
            if self.threads > 1 and self._blas.available:
                self._blas.set(self.threads)
            _matmul(rows, self.lm_head, logits, GEMV_ROWS_HEAD)
        out = torch.from_numpy(logits)
        if len(counts) == 1:
            return [out]
        res, a = [], 0
        for c in counts:
            res.append(out[a : a + c])
            a += c
        return res
