from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and do not fight other processes for the 2 CI cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def plugin_log(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], list[logging.LogRecord]]]:
    """The plugin logger's records, whether or not vLLM's logging configuration (set up once any test imported vLLM)
    stops them at vLLM's non-propagating logger: pytest's capture handler is attached to the plugin's logger too, and
    a record both places saw counts once. vLLM's logging configuration resets the handlers of the loggers below
    vLLM's, the plugin's among them, when vLLM is first imported: it is imported first, where there is one."""
    from specdec.vllm_plugin.logs import LOGGER_NAME

    with contextlib.suppress(ImportError):
        import vllm.logger  # noqa: F401 - configures vLLM's logging on import

    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(caplog.handler)
    try:
        yield lambda: list({id(r): r for r in caplog.records}.values())
    finally:
        logger.removeHandler(caplog.handler)


VLLM_GLUE_PREFIX = "test_vllm_"  # every test in tests/test_vllm_*.py is a vLLM glue test; others opt in with the marker


@pytest.fixture
def toys(monkeypatch, tmp_path):
    """The toy drafter registered and a fresh trace cache (bad-input tests: ``pytestmark``'s usefixtures)."""
    from specdec.drafters import registry

    monkeypatch.setitem(registry._CLASSES, "toy", "eval_toys:LookupDrafter")
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECDEC_DATA", raising=False)


@pytest.fixture
def no_replay(monkeypatch):
    """Fails the test if a replay starts: errors must come before any long work."""

    def boom(*args, **kwargs):
        raise AssertionError("replay started before the bad input was reported")

    monkeypatch.setattr("specdec.eval.run_replay.replay", boom)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name.startswith(VLLM_GLUE_PREFIX):
            item.add_marker(pytest.mark.vllm)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine; results under eval/results/)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
