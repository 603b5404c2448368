"""The proposer's drafting thread: run a job, give up waiting at a deadline (the job keeps running)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class DraftWorker:
    """Runs drafter work on one background thread so a step can give up waiting at a deadline.

    All drafter calls (lifecycle ops and drafting) run on that one thread, in submission order, so the drafter
    needs no locking. While a timed-out job still runs, later steps queue their ops and get no drafts. The
    hand-off is two plain locks (cheaper than a thread pool's futures: this runs every engine step).
    """

    def __init__(self) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._fn: Callable[[], Any] | None = None
        self._result: Any = None
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="specdec-draft", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            if self._closed:
                return
            try:
                self._result = self._fn() if self._fn is not None else None
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                self._result = exc
            self._done.release()

    @property
    def busy(self) -> bool:
        if self._busy and self._done.acquire(blocking=False):  # a timed-out job finished meanwhile
            self._busy, self._result = False, None  # its result is stale: dropped
        return self._busy

    def run(self, fn: Callable[[], Any], timeout_s: float) -> tuple[bool, Any]:
        """(finished, result) of ``fn`` run on the worker, waiting at most ``timeout_s``. Not while busy."""
        self._fn, self._busy = fn, True
        self._go.release()
        if not self._done.acquire(timeout=timeout_s):
            return False, None
        self._busy = False
        result, self._result = self._result, None
        if isinstance(result, BaseException):
            raise result
        return True, result

    def close(self) -> None:
        self._closed = True
        if not self._busy:
            self._go.release()
