"""The draft model's Llama forward in C++ (backend ``native``): SIMD kernels on a private thread pool.

At batch 1 a 7M-parameter draft model does ~14 MFLOP per token. torch, ONNX Runtime and numpy spend most of
a decode step dispatching ops (tens of them per layer) and streaming fp32 weights; the native forward
(``csrc/llama_native.cpp``, built as ``specdec.drafters._llama_native``) runs the whole step in one call:

* weights stay **bf16** when the checkpoint is bf16 (exact: they are widened to fp32 in registers, all
  arithmetic is fp32), which halves the bytes a step streams; ``weights="fp32"`` keeps fp32 copies;
* each pool thread owns the same 4-row slices of every matrix on every call, so with 8 threads each thread's
  ~1.8 MB of the 7M model stays in its own L2 cache;
* kernels are compiled for AVX-512, AVX2+FMA and SSE2 from one source and picked by CPU features at load
  (``isa`` forces one: the tests compare them);
* phases are separated by spin barriers (~33 per step); idle workers spin ``spin_us`` after a forward (the
  drafter calls forward back to back), then sleep on a futex, so an idle drafter costs no CPU;
* the GIL is released for the whole forward.

Math: Hugging Face's Llama in fp32 (RMSNorm, rotate-half rotary, grouped-query attention with max-subtracted
softmax, SwiGLU); only the summation order differs from torch, so logits agree to ~1e-5 relative.

Each request's KV cache is one numpy array, per layer and kv head a keys block stored transposed
(``[head_dim, capacity]``: q.k for all positions is head_dim vector axpys, no horizontal sums) and a values block
(``[capacity, head_dim]``), so attention streams contiguous memory. It grows by doubling; rollback (``crop``)
just lowers the filled length.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.drafters.model_backends import DraftBackend, StepInput
from specdec.drafters.model_llama import LlamaShape, load_safetensors

logger = logging.getLogger("specdec.drafters.model")

INITIAL_CAPACITY = 256  # cache slots of a new request (grows by doubling)
DEFAULT_SPIN_US = 200  # worker spin after a forward before sleeping: covers the drafter's work between forwards
WEIGHT_CHOICES = ("auto", "bf16", "fp32")
ISA_CHOICES = ("auto", "avx512", "avx2", "sse")
F32 = np.float32


def _native_module() -> Any:
    try:
        from specdec.drafters import _llama_native
    except ImportError as exc:
        raise ImportError(
            "backend='native' needs the C++ extension specdec.drafters._llama_native, which was not "
            "built; reinstall with a C++20 compiler (pip install -e .) or pick another backend"
        ) from exc
    return _llama_native


class NativeState:
    """One request's KV cache ``cache`` [layers, 2 (k|v), kv_heads, capacity * head_dim]: per head, keys are
    stored transposed ([head_dim, capacity]) and values as [capacity, head_dim]; slots ``[:length]`` are filled."""

    __slots__ = ("cache", "length", "address", "head_dim")

    def __init__(self, head_shape: tuple[int, int, int], head_dim: int, capacity: int) -> None:
        self.cache = np.empty(head_shape + (capacity * head_dim,), F32)
        self.head_dim = head_dim
        self.length = 0
        self.address = self.cache.__array_interface__["data"][0]

    @property
    def capacity(self) -> int:
        return self.cache.shape[3] // self.head_dim

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        old, cap, hd, filled = self.cache, self.capacity, self.head_dim, self.length
        new_cap = max(n, 2 * cap)
        bigger = np.empty(old.shape[:3] + (new_cap * hd,), F32)
        lead = old.shape[0], old.shape[2]  # layers, kv_heads
        bigger[:, 0].reshape(*lead, hd, new_cap)[..., :filled] = old[:, 0].reshape(*lead, hd, cap)[..., :filled]
        bigger[:, 1].reshape(*lead, new_cap, hd)[..., :filled, :] = old[:, 1].reshape(*lead, cap, hd)[..., :filled, :]
        self.cache = bigger
        self.address = bigger.__array_interface__["data"][0]


def _as_weight(t: torch.Tensor, bf16: bool) -> np.ndarray:
    if bf16:
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    return np.ascontiguousarray(t.to(torch.float32).numpy())


def _as_f32(t: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(t.to(torch.float32).numpy())


class NativeLlamaBackend(DraftBackend):
    """See the module docstring. ``threads`` 0 = torch's intra-op thread count; ``cpus`` pins the workers."""

    name = "native"

    def __init__(
        self,
        path: str | Path,
        *,
        threads: int = 0,
        weights: str = "auto",
        isa: str = "auto",
        cpus: Sequence[int] = (),
        spin_us: int = DEFAULT_SPIN_US,
    ) -> None:
        if weights not in WEIGHT_CHOICES:
            raise ValueError(f"weights={weights!r} is unknown; valid: {', '.join(WEIGHT_CHOICES)}")
        if isa not in ISA_CHOICES:
            raise ValueError(f"isa={isa!r} is unknown; valid: {', '.join(ISA_CHOICES)}")
        native = _native_module()
        path = Path(path)
        s = LlamaShape.load(path)
        self.shape = s
        self.vocab_size, self.max_positions = s.vocab, s.max_positions
        raw = load_safetensors(path)
        bf16 = weights == "bf16" or (
            weights == "auto" and all(t.dtype == torch.bfloat16 for t in raw.values() if t.is_floating_point())
        )
        self._arrays = self._layout(raw, bf16)  # kept alive: the extension borrows them
        shape = (s.vocab, s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.max_positions, s.eps)
        a = self._arrays
        self._model = native.create(
            shape,
            bf16,
            a["embed"],
            a["lm_head"],
            a["final_norm"],
            a["layers"],
            a["cos"],
            a["sin"],
            int(threads or torch.get_num_threads()),
            [int(c) for c in cpus],
            int(spin_us),
            isa,
        )
        self._forward = native.forward
        self.info = dict(native.info(self._model))
        self.name = "native" if weights == "auto" else f"native-{weights}"
        self._heads = (s.layers, 2, s.kv_heads)

    def _layout(self, raw: dict[str, torch.Tensor], bf16: bool) -> dict[str, Any]:
        s = self.shape
        embed = raw["model.embed_tokens.weight"]  # [V, d]
        head = embed if s.tied or "lm_head.weight" not in raw else raw["lm_head.weight"]  # [V, d]
        layers = []
        for i in range(s.layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([raw[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])  # [(H + 2 KVH) hd, d]
            gate, up = raw[p + "mlp.gate_proj.weight"], raw[p + "mlp.up_proj.weight"]  # [I, d] each
            gate_up = torch.stack([gate, up], 1).reshape(2 * s.intermediate, s.hidden)  # rows g0, u0, g1, u1, ...
            layers.append(
                (
                    _as_weight(qkv, bf16),
                    _as_weight(raw[p + "self_attn.o_proj.weight"], bf16),
                    _as_weight(gate_up, bf16),
                    _as_weight(raw[p + "mlp.down_proj.weight"], bf16),
                    _as_f32(raw[p + "input_layernorm.weight"]),
                    _as_f32(raw[p + "post_attention_layernorm.weight"]),
                )
            )
        hd = s.head_dim
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))  # [hd/2], as HF
        ang = torch.arange(s.max_positions, dtype=torch.float32)[:, None] * inv[None]  # [P, hd/2]
        return {
            "embed": _as_weight(embed, bf16),
            "lm_head": _as_weight(head, bf16),
            "final_norm": _as_f32(raw["model.norm.weight"]),
            "layers": layers,
            "cos": _as_f32(ang.cos()),
            "sin": _as_f32(ang.sin()),
        }

    def describe(self) -> str:
        return f"native ({self.info['isa']}, {self.info['weights']} weights, {self.info['threads']} threads)"

    def new_state(self) -> NativeState:
        return NativeState(self._heads, self.shape.head_dim, INITIAL_CAPACITY)

    def length(self, state: NativeState) -> int:
        return state.length

    def crop(self, state: NativeState, n: int) -> None:
        state.length = min(state.length, max(0, int(n)))

    def state_bytes(self, state: NativeState) -> int:
        return int(state.cache.nbytes)

    def forward(self, items: Sequence[StepInput]) -> list[torch.Tensor]:
        out = self._run(items, 0)[0]
        logits, row = [], 0
        for it in items:
            logits.append(torch.from_numpy(out[row : row + len(it.want)]))
            row += len(it.want)
        return logits

    def forward_topk(self, items: Sequence[StepInput], k: int) -> tuple[list[list[float]], list[list[int]]]:
        """``forward``, but returns each wanted row's ``k`` most likely tokens (best first) and their softmax
        probabilities, computed inside the call (no torch ops between the drafter's forwards)."""
        _, probs, ids = self._run(items, max(1, min(int(k), self.vocab_size)))
        return probs.tolist(), ids.tolist()

    def _run(self, items: Sequence[StepInput], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tokens: list[int] = []
        positions: list[int] = []
        starts, want, addrs, cached, caps, moff = [0], [], [], [], [], []
        masks: list[np.ndarray] = []
        mask_bytes = 0
        for it in items:
            st, n = it.state, len(it.tokens)
            if len(it.positions) != n:
                raise ValueError(f"StepInput: {n} tokens but {len(it.positions)} positions")
            st.reserve(st.length + n)
            base = starts[-1]
            tokens.extend(it.tokens)
            positions.extend(it.positions)
            starts.append(base + n)
            want.extend(base + int(w) for w in it.want)
            addrs.append(st.address)
            cached.append(st.length)
            caps.append(st.capacity)
            if it.mask is None:
                moff.append(-1)
            else:
                m = np.ascontiguousarray(it.mask, dtype=np.uint8)
                if m.shape != (n, st.length + n):
                    raise ValueError(f"StepInput.mask has shape {m.shape}, expected {(n, st.length + n)}")
                moff.append(mask_bytes)
                masks.append(m.reshape(-1))
                mask_bytes += m.size
        out = np.empty((len(want), self.vocab_size), F32)  # [wanted rows, V]
        top = (np.empty((len(want), k), F32), np.empty((len(want), k), np.int32)) if k else ()  # [rows, k] each
        i32 = np.int32
        self._forward(
            self._model,
            np.array(tokens, i32),
            np.array(positions, i32),
            np.array(starts, i32),
            np.array(addrs, np.uint64),
            np.array(cached, i32),
            np.array(caps, i32),
            np.array(moff, np.int64),
            np.concatenate(masks) if masks else np.zeros(0, np.uint8),
            np.array(want, i32),
            out,
            *top,
        )
        for it in items:
            it.state.length += len(it.tokens)
        return (out,) + (top or (None, None))
