"""The keyword a Hugging Face model's ``forward`` takes its KV cache under.

transformers 5.x renamed ``past_key_values`` to ``cache`` (the old name warns with a FutureWarning on every call and
goes in 5.40); 4.x knows only ``past_key_values``. ``cache_kwargs(model, cache)`` gives the one this model's forward
takes, read from its signature, so neither version warns.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

NEW_NAME = "cache"  # transformers >= 5.x
OLD_NAME = "past_key_values"  # transformers 4.x (deprecated in 5.x, removed in 5.40)


@functools.cache
def _keyword(forward: Any) -> str:
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return OLD_NAME
    return NEW_NAME if NEW_NAME in params else OLD_NAME


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``: what ``model.forward`` takes (``use_cache`` on)."""
    return {_keyword(type(model).forward): cache, "use_cache": True}
