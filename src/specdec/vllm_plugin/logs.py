"""The plugin's logger, ``LOGGER_NAME``: a child of vLLM's ``vllm`` logger, so the plugin's lines go where vLLM's go.

vLLM configures only its own ``vllm`` logger (``VLLM_CONFIGURE_LOGGING``, on by default: a handler with vLLM's
format at ``VLLM_LOGGING_LEVEL``, not propagating to the root). A logger below it needs no set-up of its own: its
records propagate to vLLM's handler, at vLLM's level, from whenever vLLM configured it (some releases do so only when
an engine starts, after the plugins loaded); where vLLM's logging is off they go on to the root logger as any
library's records would. The plugin adds no handler: each record takes that one path, so a handler attached to
several loggers (pytest's log capture attaches to every non-propagating one) sees it once.
"""

from __future__ import annotations

LOGGER_NAME = "vllm.specdec"  # every vllm_plugin module logs here
