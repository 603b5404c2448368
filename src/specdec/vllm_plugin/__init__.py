"""vLLM glue (the only place that imports vLLM). ``register`` is the ``vllm.general_plugins`` entry point."""

from __future__ import annotations


def register() -> None:
    """Entry point loaded by vLLM in every process; see ``specdec.vllm_plugin.entry.register``."""
    from specdec.vllm_plugin.entry.register import register as _register

    _register()
