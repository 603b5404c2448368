"""Forward-pass backends of the draft model (``ModelDrafter``), all on the CPU.

A backend owns the weights and one KV cache per request (a *state*). The drafter drives it with
``forward(items)``: each ``StepInput`` appends ``tokens`` to a state's cache at the given
``positions`` and returns the logits of the rows listed in ``want``. ``mask`` (bool
``[n, cached + n]``) says which cache slots and new tokens each new token attends to (tree drafting);
``None`` means plain causal attention. ``crop(state, n)`` drops every slot from ``n`` on (rollback).

Backends: ``eager`` (Hugging Face ``forward``, one request at a time; the baseline), and the
hand-written Llama forward of ``specdec.drafters.model_llama`` (``torch``, ``torch-bf16``,
``compile``), ONNX Runtime (``specdec.drafters.model_onnx``), numpy (``specdec.drafters.model_numpy``) and
the C++ forward (``native``, ``specdec.drafters.model_native``). ``make_backend`` builds one by name.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specdec.hf_cache import cache_kwargs

logger = logging.getLogger("specdec.drafters.model")

# name -> (module, class, kwargs); kept as strings so optional dependencies load only when used
BACKENDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "eager": ("specdec.drafters.model_backends", "EagerHFBackend", {}),
    "torch": ("specdec.drafters.model_llama", "TorchLlamaBackend", {"dtype": "float32"}),
    "torch-bf16": ("specdec.drafters.model_llama", "TorchLlamaBackend", {"dtype": "bfloat16"}),
    "compile": ("specdec.drafters.model_llama", "TorchLlamaBackend", {"dtype": "float32", "compile": True}),
    "onnx": ("specdec.drafters.model_onnx", "OnnxBackend", {"quantize": False}),
    "onnx-int8": ("specdec.drafters.model_onnx", "OnnxBackend", {"quantize": True}),
    "numpy": ("specdec.drafters.model_numpy", "NumpyLlamaBackend", {}),
    "native": ("specdec.drafters.model_native", "NativeLlamaBackend", {}),
    "native-fp32": ("specdec.drafters.model_native", "NativeLlamaBackend", {"weights": "fp32"}),
}
BACKEND_NAMES = tuple(BACKENDS)


@dataclass
class StepInput:
    """One request's share of a batched forward."""

    state: Any  # the backend's per-request KV state
    tokens: Sequence[int]  # [n] tokens appended to the cache
    positions: Sequence[int]  # [n] rotary positions
    want: Sequence[int]  # rows (indices into tokens) whose logits are returned
    mask: np.ndarray | None = None  # [n, cached + n] bool, None = causal


class DraftBackend(abc.ABC):
    """Weights + per-request KV caches; see the module docstring."""

    name: str = "backend"
    vocab_size: int = 0
    max_positions: int = 0

    @abc.abstractmethod
    def new_state(self) -> Any:
        """An empty KV cache for one request."""

    @abc.abstractmethod
    def length(self, state: Any) -> int:
        """Number of filled cache slots."""

    @abc.abstractmethod
    def crop(self, state: Any, n: int) -> None:
        """Drop cache slots ``n`` and later (``n <= length``)."""

    @abc.abstractmethod
    def forward(self, items: Sequence[StepInput]) -> list[torch.Tensor]:
        """Append each item's tokens to its state; logits ``[len(want), vocab]`` float32 per item."""

    def release(self, state: Any) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Free a state (request stopped)."""

    def describe(self) -> str:
        return self.name


def load_hf_model(path: str | Path, *, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A Hugging Face causal LM in eval mode on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.eval()


class EagerHFBackend(DraftBackend):
    """Hugging Face eager forward with a ``DynamicCache`` per request (one request per call)."""

    name = "eager"

    def __init__(self, path: str | Path, *, dtype: str = "float32") -> None:
        self.dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        self.model = load_hf_model(path, dtype=self.dtype)
        cfg = self.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 4096))
        self.name = "eager" if dtype == "float32" else f"eager-{dtype}"

    def new_state(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def length(self, state: Any) -> int:
        return int(state.get_seq_length())

    def crop(self, state: Any, n: int) -> None:
        cur = self.length(state)
        if n < cur:
            state.crop(n - cur)  # transformers wants the (negative) number of slots to remove

    @torch.inference_mode()
    def forward(self, items: Sequence[StepInput]) -> list[torch.Tensor]:
        out = []
        for it in items:
            ids = torch.as_tensor([list(it.tokens)], dtype=torch.long)  # [1, n]
            pos = torch.as_tensor([list(it.positions)], dtype=torch.long)  # [1, n]
            mask = None
            if it.mask is not None:
                mask = torch.from_numpy(np.ascontiguousarray(it.mask))[None, None]  # [1, 1, n, cached + n]
            hidden = self.model.model(
                input_ids=ids, position_ids=pos, attention_mask=mask, **cache_kwargs(self.model.model, it.state)
            ).last_hidden_state  # [1, n, d]
            rows = hidden[0, list(it.want)]  # [w, d]
            out.append(self.model.lm_head(rows).float())  # [w, V]
        return out


def make_backend(name: str, path: str | Path, *, onnx_spin: bool = False, threads: int = 0) -> DraftBackend:
    """Build a backend by name (see ``BACKENDS``); raises ImportError/RuntimeError when unavailable.

    ``onnx_spin``: ONNX Runtime worker threads spin between ops (lowest latency standalone; turn it off when
    the drafter shares cores with other work in the process, e.g. a CPU target model). ``threads``: the native
    backends' pool size (0 = torch's current thread count); the others follow torch's setting.
    """
    import importlib

    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is unknown; valid backends: {', '.join(BACKEND_NAMES)}")
    module, cls, kwargs = BACKENDS[name]
    if name.startswith("onnx"):
        kwargs = {**kwargs, "spin": onnx_spin}
    if name.startswith("native"):
        kwargs = {**kwargs, "threads": threads}
    return getattr(importlib.import_module(module), cls)(path, **kwargs)
