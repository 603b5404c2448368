"""A minimal Llama forward in plain torch for the draft model (own code; weights from HF safetensors).

Why: Hugging Face's eager forward spends ~100x the arithmetic of a 7M-parameter model on Python and
module overhead. ``LlamaCore`` runs the same math (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, tied embeddings) with fused QKV and gate/up weights stored pre-transposed
(``x @ W``), as a pure function of its inputs, so the same module serves the torch backends, torch.compile
and the ONNX export (``specdec.drafters.model_onnx``):

    core(tokens [B, N], pos [B, N], bias [B, 1, N, S + N], sel [W], *past)
        -> logits [W, V] (rows ``sel`` of the flattened [B * N] tokens), new_k, new_v [L, B, KVH, N, hd]
    past = (k_0 .. k_{L-1}, v_0 .. v_{L-1}), each [B, KVH, S, hd]

``PooledBackend`` keeps every request's KV cache in one pool per layer ``[rows, KVH, capacity, hd]``
(a request owns a row; live rows stay packed at the front so a batch's rows are a slice), builds the
masks for ragged batches and tree drafts, runs a core, and writes the new K/V into the pool.
``TorchLlamaBackend`` is that with ``LlamaCore`` in fp32, bf16 (oneDNN, AMX where present) or
torch.compile. Verified against Hugging Face logits in tests/test_model_backends.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from specdec.drafters.model_backends import DraftBackend, StepInput

INITIAL_ROWS = 4
INITIAL_CAPACITY = 256
SUPPORTED_ROPE = (None, "default")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NEG_INF = float("-inf")


@dataclass
class LlamaShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    max_positions: int
    tied: bool

    @classmethod
    def from_config(cls, cfg: dict[str, Any], path: Path) -> LlamaShape:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type"))
        problems = []
        if cfg.get("model_type") != "llama":
            problems.append(f"model_type={cfg.get('model_type')!r} (only 'llama')")
        if rope_type not in SUPPORTED_ROPE:
            problems.append(f"rope_type={rope_type!r} (only default rotary)")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            problems.append("attention/MLP biases")
        if cfg.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={cfg.get('hidden_act')!r}")
        if problems:
            raise ValueError(
                f"{path}: the built-in Llama forward does not support {', '.join(problems)}; "
                "use backend='eager' for this model"
            )
        heads = int(cfg["num_attention_heads"])
        return cls(
            vocab=int(cfg["vocab_size"]),
            hidden=int(cfg["hidden_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate=int(cfg["intermediate_size"]),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            max_positions=int(cfg.get("max_position_embeddings", 4096)),
            tied=bool(cfg.get("tie_word_embeddings", False)),
        )

    @classmethod
    def load(cls, path: Path) -> LlamaShape:
        return cls.from_config(json.loads((path / "config.json").read_text()), path)


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF folder (single file or sharded with an index)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(str(path / name)))
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and not torch.onnx.is_in_onnx_export():
        return F.rms_norm(x, (x.shape[-1],), w, eps)  # one fused op; same math as below in fp32
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class LlamaCore(torch.nn.Module):
    """The pure Llama forward (see the module docstring); weights as parameters, pre-transposed."""

    def __init__(self, path: Path, shape: LlamaShape, dtype: torch.dtype) -> None:
        super().__init__()
        self.shape = shape
        raw = load_safetensors(path)
        get = lambda k: raw[k].to(dtype)  # noqa: E731
        param = lambda t: torch.nn.Parameter(t.contiguous(), requires_grad=False)  # noqa: E731
        self.embed = param(get("model.embed_tokens.weight"))  # [V, d]
        head = self.embed if shape.tied or "lm_head.weight" not in raw else get("lm_head.weight")
        self.lm_head = param(head.t())  # [d, V]
        self.norm = param(get("model.norm.weight"))  # [d]
        self.ln1, self.qkv, self.o, self.ln2, self.gate_up, self.down = (torch.nn.ParameterList() for _ in range(6))
        for i in range(shape.layers):
            p = f"model.layers.{i}."
            self.ln1.append(param(get(p + "input_layernorm.weight")))  # [d]
            qkv = torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            self.qkv.append(param(qkv.t()))  # [d, (H+2KVH)*hd]
            self.o.append(param(get(p + "self_attn.o_proj.weight").t()))  # [H*hd, d]
            self.ln2.append(param(get(p + "post_attention_layernorm.weight")))  # [d]
            gu = torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
            self.gate_up.append(param(gu.t()))  # [d, 2I]
            self.down.append(param(get(p + "mlp.down_proj.weight").t()))  # [I, d]
        exponents = torch.arange(0, shape.head_dim, 2, dtype=torch.int64).float() / shape.head_dim
        inv = 1.0 / (shape.rope_theta**exponents)  # [hd/2], computed like transformers' default rotary
        ang = torch.arange(shape.max_positions, dtype=torch.float32)[:, None] * inv[None]  # [P, hd/2]
        ang = torch.cat([ang, ang], dim=-1)  # [P, hd]
        self.register_buffer("cos", ang.cos().to(dtype), persistent=False)
        self.register_buffer("sin", ang.sin().to(dtype), persistent=False)

    def forward(
        self, tokens: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, sel: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.shape
        past_k, past_v = past[: s.layers], past[s.layers :]
        B, N = tokens.shape
        H, KVH, hd = s.heads, s.kv_heads, s.head_dim
        G = H // KVH
        x = F.embedding(tokens, self.embed)  # [B, N, d]
        cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)  # [B, 1, N, hd]
        S = past_k[0].shape[2]
        bias = bias.repeat(1, 1, G, 1)  # [B, 1, G*N, S + N]: rows of a kv group are (head, token) pairs
        scale = 1.0 / math.sqrt(hd)
        new_k, new_v = [], []
        for li in range(s.layers):
            qkv = torch.matmul(_rms(x, self.ln1[li], s.eps), self.qkv[li])  # [B, N, (H+2KVH)*hd]
            qkv = qkv.view(B, N, H + 2 * KVH, hd).transpose(1, 2)  # [B, H+2KVH, N, hd]
            qk = _rotate(qkv[:, : H + KVH], cos, sin)  # [B, H+KVH, N, hd]
            q = qk[:, :H].reshape(B, KVH, G * N, hd)  # the heads of a group share one kv head
            k = qk[:, H:]  # [B, KVH, N, hd]
            v = qkv[:, H + KVH :]  # [B, KVH, N, hd]
            new_k.append(k)
            new_v.append(v)
            # scores against the cached slots and the new tokens, one softmax over both (no K/V concat)
            att = (
                torch.cat([torch.matmul(q, past_k[li].transpose(-1, -2)), torch.matmul(q, k.transpose(-1, -2))], dim=-1)
                * scale
                + bias
            )  # [B, KVH, G*N, S+N]
            att = torch.softmax(att.float(), dim=-1).to(x.dtype)
            o = torch.matmul(att[..., :S], past_v[li]) + torch.matmul(att[..., S:], v)  # [B, KVH, G*N, hd]
            o = o.reshape(B, H, N, hd).transpose(1, 2).reshape(B, N, H * hd)
            x = x + torch.matmul(o, self.o[li])
            g, u = torch.matmul(_rms(x, self.ln2[li], s.eps), self.gate_up[li]).chunk(2, dim=-1)  # [B, N, I] x2
            x = x + torch.matmul(F.silu(g) * u, self.down[li])
        h = x.reshape(B * N, -1).index_select(0, sel)  # [W, d]
        logits = torch.matmul(_rms(h, self.norm, s.eps), self.lm_head).float()  # [W, V]
        return logits, torch.stack(new_k), torch.stack(new_v)


@dataclass
class PoolState:
    row: int
    length: int = 0


class PooledBackend(DraftBackend):
    """KV pool, ragged batching and masks around a pure core; subclasses implement ``_run``."""

    contiguous_past = False  # True: pass whole pool rows (full capacity) as past, e.g. for ONNX Runtime

    @torch.inference_mode()  # pool tensors are inference tensors, written only in inference mode
    def _init_pool(self, shape: LlamaShape, dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype
        self.vocab_size, self.max_positions = shape.vocab, shape.max_positions
        size = (INITIAL_ROWS, shape.kv_heads, INITIAL_CAPACITY, shape.head_dim)
        self.k = [torch.zeros(size, dtype=dtype) for _ in range(shape.layers)]  # L x [R, KVH, cap, hd]
        self.v = [torch.zeros(size, dtype=dtype) for _ in range(shape.layers)]
        self._owner: list[PoolState | None] = [None] * INITIAL_ROWS

    def _run(
        self, tokens: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, sel: torch.Tensor, past: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    # ------------------------------------------------------------------ states
    def new_state(self) -> PoolState:
        if None not in self._owner:
            self._grow(rows=2 * len(self._owner))
        row = self._owner.index(None)
        st = PoolState(row)
        self._owner[row] = st
        return st

    @torch.inference_mode()
    def release(self, state: PoolState) -> None:
        if not (0 <= state.row < len(self._owner) and self._owner[state.row] is state):
            return
        last = max(i for i, o in enumerate(self._owner) if o is not None)
        if last != state.row:  # keep live rows packed at the front (a full batch is a slice)
            moved = self._owner[last]
            for pool in self.k + self.v:
                pool[state.row, :, : moved.length] = pool[last, :, : moved.length]
            self._owner[state.row], moved.row = moved, state.row
        self._owner[last] = None
        state.row = -1

    def length(self, state: PoolState) -> int:
        return state.length

    def crop(self, state: PoolState, n: int) -> None:
        state.length = min(state.length, n)

    def state_bytes(self, state: PoolState) -> int:
        s = self.shape
        return 2 * s.layers * s.kv_heads * state.length * s.head_dim * self.k[0].element_size()

    @torch.inference_mode()
    def _grow(self, *, rows: int | None = None, capacity: int | None = None) -> None:
        R, KVH, cap, hd = self.k[0].shape
        rows, capacity = max(rows or R, R), max(capacity or cap, cap)

        def bigger(old: torch.Tensor) -> torch.Tensor:
            new = torch.zeros(rows, KVH, capacity, hd, dtype=self.dtype)
            new[:R, :, :cap] = old
            return new

        self.k = [bigger(t) for t in self.k]
        self.v = [bigger(t) for t in self.v]
        self._owner += [None] * (rows - R)

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, items: Sequence[StepInput]) -> list[torch.Tensor]:
        if not items:
            return []
        order = sorted(range(len(items)), key=lambda i: items[i].state.row)
        batch = [items[i] for i in order]
        lens = np.asarray([it.state.length for it in batch], np.int64)  # [B]
        ns = np.asarray([len(it.tokens) for it in batch], np.int64)  # [B]
        B, N = len(batch), int(ns.max())
        if int(lens.max()) + N > self.capacity:
            self._grow(capacity=max(2 * self.capacity, int(lens.max()) + N))
        S = self.capacity if self.contiguous_past else int(lens.max())
        rows = [it.state.row for it in batch]
        valid = np.arange(N)[None, :] < ns[:, None]  # [B, N] real (not padding) tokens
        tokens = np.zeros((B, N), np.int64)
        pos = np.zeros((B, N), np.int64)
        tokens[valid] = np.fromiter((t for it in batch for t in it.tokens), np.int64, int(ns.sum()))
        pos[valid] = np.fromiter((p for it in batch for p in it.positions), np.int64, int(ns.sum()))
        sel = torch.as_tensor([i * N + j for i, it in enumerate(batch) for j in it.want])  # [W]
        if rows == list(range(rows[0], rows[0] + B)):
            past = [t[rows[0] : rows[0] + B, :, :S] for t in self.k + self.v]  # 2L x [B, KVH, S, hd] views
        else:
            idx = torch.as_tensor(rows)
            past = [t[idx, :, :S] for t in self.k + self.v]  # copies
        bias = self._bias(batch, lens, N, S)  # [B, 1, N, S + N]
        logits, new_k, new_v = self._run(torch.from_numpy(tokens), torch.from_numpy(pos), bias, sel, past)
        self._write_kv(np.asarray(rows), lens, valid, new_k, new_v)
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        start = 0
        for i, it in zip(order, batch):
            out[i] = logits[start : start + len(it.want)]
            start += len(it.want)
            it.state.length += len(it.tokens)
        return out

    def _write_kv(
        self, rows: np.ndarray, lens: np.ndarray, valid: np.ndarray, new_k: torch.Tensor, new_v: torch.Tensor
    ) -> None:
        """Scatter the new K/V ``[L, B, KVH, N, hd]`` of valid tokens into slots ``len ..`` of each row."""
        b_idx, j_idx = np.nonzero(valid)  # [M] each
        r_idx = torch.from_numpy(rows[b_idx])
        s_idx = torch.from_numpy(lens[b_idx] + j_idx)
        b_t, j_t = torch.from_numpy(b_idx), torch.from_numpy(j_idx)
        for li in range(self.shape.layers):
            self.k[li][r_idx, :, s_idx] = new_k[li][b_t, :, j_t]  # [M, KVH, hd]
            self.v[li][r_idx, :, s_idx] = new_v[li][b_t, :, j_t]

    def _bias(self, batch: Sequence[StepInput], lens: np.ndarray, N: int, S: int) -> torch.Tensor:
        """Additive attention bias ``[B, 1, N, S + N]``: past slots ``< len`` then the N new tokens (causal).

        Items with a tree ``mask`` ([n, len + n]) get it instead; padding query rows see only new token 0.
        """
        B = len(batch)
        visible = np.zeros((B, N, S + N), dtype=bool)
        visible[:, :, :S] = (np.arange(S)[None, :] < lens[:, None])[:, None, :]
        visible[:, :, S:] = np.tril(np.ones((N, N), dtype=bool))[None]
        for i, it in enumerate(batch):
            if it.mask is not None:
                past, n = int(lens[i]), len(it.tokens)
                m = np.asarray(it.mask, dtype=bool)  # [n, past + n]
                visible[i] = False
                visible[i, :n, :past] = m[:, :past]
                visible[i, :n, S : S + n] = m[:, past:]
                visible[i, n:, S] = True
        bias = np.where(visible, np.float32(0.0), np.float32(NEG_INF))[:, None]  # [B, 1, N, S + N]
        return torch.from_numpy(bias).to(self.dtype)


class TorchLlamaBackend(PooledBackend):
    """``LlamaCore`` in torch: fp32, bf16 (oneDNN; AMX on Xeons that have it) or torch.compile'd."""

    def __init__(self, path: str | Path, *, dtype: str = "float32", compile: bool = False) -> None:
        path = Path(path)
        shape = LlamaShape.load(path)
        self._init_pool(shape, DTYPES[dtype])
        self.core = LlamaCore(path, shape, DTYPES[dtype]).eval()
        self.name = "torch" if dtype == "float32" else f"torch-{dtype}"
        self._fn = self.core
        if compile:
            self.name = "compile" if dtype == "float32" else f"compile-{dtype}"
            self._fn = torch.compile(self.core, dynamic=True)

    def _run(
        self, tokens: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, sel: torch.Tensor, past: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._fn(tokens, pos, bias, sel, *past)
