"""The plugin's logger (``LOGGER_NAME``) and its route to vLLM's log output.

vLLM configures only its own ``vllm`` logger (``VLLM_CONFIGURE_LOGGING``, on by default: a handler with vLLM's format,
at ``VLLM_LOGGING_LEVEL``), and 0.32 does so only when an engine starts, after the plugins loaded. A logger outside
that tree has no handler, so under vLLM the plugin's INFO lines (its start-up summary, the compile warm-up, the
``log_every_s`` statistics) never showed and its warnings printed bare through Python's last-resort handler.
``follow_vllm_logging`` (called by the plugin's entry point in every vLLM process) gives the plugin's logger a
handler that passes each record to vLLM's logger when it is emitted, so it lands wherever and however vLLM's own
lines do, under vLLM's level; where vLLM's logging is switched off, records go on as Python would send them.
"""
from __future__ import annotations

import logging
import os

LOGGER_NAME = "specdec.vllm"  # every vllm_plugin module logs here
VLLM_LOGGER_NAME = "vllm"
LEVEL_ENV, DEFAULT_LEVEL = "VLLM_LOGGING_LEVEL", "INFO"  # vLLM's level setting (read once, for record creation)


class VllmForwarder(logging.Handler):
    """Hands each record to the logger ``target`` (default vLLM's) if it has handlers, under its effective level;
    otherwise to the root logger's handlers, or Python's last-resort handler for warnings and errors."""

    def __init__(self, target: str = VLLM_LOGGER_NAME) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        theirs = logging.getLogger(self.target)
        if theirs.handlers:
            if record.levelno >= theirs.getEffectiveLevel():
                theirs.handle(record)
            return
        root = logging.getLogger()
        if root.handlers:
            if record.levelno >= root.level:
                root.handle(record)
        elif record.levelno >= logging.WARNING and logging.lastResort is not None:
            logging.lastResort.handle(record)


def follow_vllm_logging(ours: logging.Logger | None = None, target: str = VLLM_LOGGER_NAME) -> bool:
    """Route ``ours`` (default: the plugin's logger) through a ``VllmForwarder`` to ``target``, at vLLM's configured
    level (``VLLM_LOGGING_LEVEL``), not propagating further (no duplicate lines at the root). Left alone when
    ``ours`` has handlers already (the user's logging config wins; a second call changes nothing). Returns True if
    routed."""
    ours = ours if ours is not None else logging.getLogger(LOGGER_NAME)
    if ours.handlers:
        return False
    ours.addHandler(VllmForwarder(target))
    level = logging.getLevelName(os.environ.get(LEVEL_ENV, DEFAULT_LEVEL).upper())
    ours.setLevel(level if isinstance(level, int) else logging.INFO)
    ours.propagate = False
    return True
