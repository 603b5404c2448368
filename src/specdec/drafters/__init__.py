"""CPU drafters behind one interface (``Drafter``), built by name with ``build_drafter``.

Names: ``suffix`` (suffix trees over the request and past responses), ``ngram`` (prompt lookup),
``model`` (a small causal LM on the CPU); a list composes them, choosing per request and step the
draft with the best score (``["suffix", "model"]`` is the hybrid). Peers used in benchmarks only:
``arctic`` (ArcticInference's SuffixDecodingCache) and ``vllm-ngram`` (vLLM's prompt-lookup rule).
No module here imports vLLM.
"""

from __future__ import annotations

from specdec.drafters.base import Drafter, DraftGuard, DraftRequest, GuardStats
from specdec.drafters.registry import DRAFTER_NAMES, build_drafter

__all__ = ["Drafter", "DraftRequest", "DraftGuard", "GuardStats", "build_drafter", "DRAFTER_NAMES"]
