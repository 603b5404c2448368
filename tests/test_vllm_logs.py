"""The plugin's logger sits below vLLM's: its lines reach vLLM's handler at vLLM's level, once each, and go on to the
root logger where vLLM's logging is off. The tests set vLLM's logger up by hand (as vLLM's logging configuration
does) and restore it afterwards; the last one checks the hierarchy under a real vLLM."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from specdec.vllm_plugin.logs import LOGGER_NAME

VLLM = "vllm"


class Records(logging.Handler):
    """Keeps every record it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def theirs() -> Iterator[logging.Logger]:
    """vLLM's logger, restored (handlers, level, propagation) afterwards. The tests empty its handlers in their body:
    pytest attaches its capture handler to non-propagating loggers after the fixtures ran."""
    logger = logging.getLogger(VLLM)
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    try:
        yield logger
    finally:
        logger.handlers = handlers
        logger.propagate = propagate
        logger.setLevel(level)


def configure_like_vllm(logger: logging.Logger, level: int) -> io.StringIO:
    """What vLLM's logging configuration does to its logger: one stream handler in its format, its level, no
    propagation to the root."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("VLLM %(levelname)s %(message)s"))
    logger.handlers = [handler]
    logger.setLevel(level)
    logger.propagate = False
    return stream


def test_lines_reach_vllms_handler_at_its_level(theirs):
    ours = logging.getLogger(LOGGER_NAME)
    stream = configure_like_vllm(theirs, logging.WARNING)
    ours.info("specdec: below vLLM's level")
    theirs.setLevel(logging.INFO)
    ours.info("specdec: drafted %d", 7)
    ours.debug("specdec: below vLLM's level again")
    assert stream.getvalue() == "VLLM INFO specdec: drafted 7\n"
    assert ours.handlers == [] and ours.level == logging.NOTSET  # vLLM's level decides, no set-up of our own


def test_a_handler_on_every_non_propagating_logger_sees_each_record_once(theirs, monkeypatch):
    """pytest's log capture attaches its handler to the root and to every non-propagating logger (vLLM's among them):
    a record of the plugin's still reaches it once."""
    configure_like_vllm(theirs, logging.INFO)
    capture = Records()
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [*root.handlers, capture])
    ours = logging.getLogger(LOGGER_NAME)
    for logger in [ours, *root.manager.loggerDict.values()]:
        if isinstance(logger, logging.Logger) and not logger.propagate:
            monkeypatch.setattr(logger, "handlers", [*logger.handlers, capture])
    ours.warning("specdec: drafting took longer than draft_timeout_ms=%d", 20)
    assert [r.getMessage() for r in capture.records] == ["specdec: drafting took longer than draft_timeout_ms=20"]


@pytest.fixture
def root_at_warning() -> Iterator[logging.Logger]:
    """The root logger at Python's default level (some of vLLM's dependencies change it), restored after."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.WARNING)
    try:
        yield root
    finally:
        root.setLevel(level)


def test_with_vllms_logging_off_records_go_on_as_pythons_would(theirs, root_at_warning, monkeypatch):
    """VLLM_CONFIGURE_LOGGING=0: no handler on vLLM's logger; warnings reach Python's last-resort handler, INFO stays
    quiet (the root's WARNING level), and a root handler the user set gets the records its level admits."""
    theirs.handlers = []
    theirs.propagate = True
    theirs.setLevel(logging.NOTSET)
    ours = logging.getLogger(LOGGER_NAME)
    last = io.StringIO()
    monkeypatch.setattr(logging, "lastResort", logging.StreamHandler(last))
    monkeypatch.setattr(root_at_warning, "handlers", [])  # a bare Python (pytest's capture aside)
    ours.info("specdec: quiet")
    ours.warning("specdec: a warning")
    assert last.getvalue() == "specdec: a warning\n"
    users = Records()
    root_at_warning.handlers = [users]
    ours.warning("specdec: to the user's handler")
    assert [r.getMessage() for r in users.records] == ["specdec: to the user's handler"]
    assert last.getvalue() == "specdec: a warning\n"


def test_under_a_real_vllm_the_plugin_logger_is_a_child_of_vllms():
    pytest.importorskip("vllm.logger")  # vLLM's logging configuration runs as it is imported
    ours = logging.getLogger(LOGGER_NAME)
    assert ours.parent is logging.getLogger(VLLM)
    assert ours.getEffectiveLevel() == logging.getLogger(VLLM).getEffectiveLevel()
