"""vLLM glue (the only place that imports vLLM). ``register`` is the ``vllm.general_plugins`` entry point."""
from __future__ import annotations


def register() -> None:
    """Entry point loaded by vLLM in every process; see ``specdec.vllm_plugin.plugin``."""
    from specdec.vllm_plugin.plugin import register as _register

    _register()
