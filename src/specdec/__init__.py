"""specdec: speculative decoding with CPU drafters, for vLLM and as a library.

    import specdec
    drafter = specdec.build_drafter("suffix")
    result = specdec.generate(target, prompts, drafter=drafter, tokenizer=tokenizer, max_new_tokens=128)

Sub-packages: ``specdec.drafters`` (CPU drafters), ``specdec.verifiers`` (reference tree verifier),
``specdec.eval`` (offline acceptance eval, ``specdec-eval``), ``specdec.vllm_plugin`` (vLLM glue).
"""

from __future__ import annotations

from typing import Any

from specdec.config import ConfigBase, ConfigError, load_yaml
from specdec.drafters import Drafter, DraftRequest, build_drafter
from specdec.tree import ROOT, TokenTree, merge_trees

__version__ = "0.1.0"

__all__ = [
    "TokenTree",
    "ROOT",
    "merge_trees",
    "Drafter",
    "DraftRequest",
    "build_drafter",
    "ConfigBase",
    "ConfigError",
    "load_yaml",
    "generate",
    "SpecGenerator",
    "GenerationResult",
]

_LAZY = {  # torch-heavy names load on first use
    "generate": "specdec.generation",
    "SpecGenerator": "specdec.generation",
    "GenerationResult": "specdec.generation",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
