"""The GPU waits for a step's drafts instead of the host (schedule mode's ``device_wait``).

Under vLLM's async scheduling the runner prepares step N+1 while the GPU runs step N. The host fill
(``ScheduledDrafting.fill``) drafts at the start of ``_prepare_input_ids``, which means waiting there for step N's
tokens: everything vLLM still prepares after that point (attention metadata, the graph launch) then runs while
the GPU idles (0.9-2.2 ms per step on an 8B-sized target). With a device wait the runner enqueues, on its
stream, "wait until the pinned word >= seq" and the copy of the pinned draft buffer, and prepares on without
waiting; at the start of ``_model_forward`` (every input enqueued, the forward's launch next) it drafts, writes
the buffer and stores ``seq`` (``execute_model``'s end releases too, for steps that never reach the forward).
The GPU then idles only for the drafting itself.

``cuStreamWaitValue32`` (the CUDA driver's stream memory operation) is called through ctypes; the word and its
watchdog live in ``specdec._host_flag`` (C++, no GIL). Right before waiting the stream writes ``seq`` into a second
pinned word (``cuStreamWriteValue32``): the watchdog sees when the GPU starts waiting and stores ``seq`` itself
``grace`` (``draft_timeout_ms``) later, or ``STALL_TIMEOUT_MS`` after arming whatever happens; the step then
verifies the buffer's previous drafts (lossless, counted). Kernels launched for the first time behind the wait can
block the host while CUDA loads them lazily: the watchdog frees those steps too. Unavailable (no driver
symbol, no extension, a self-test that does not pass): ``DeviceWait.create`` returns None with the reason, and
schedule mode fills from the host as before.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any

from specdec.vllm_plugin.logs import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

CU_STREAM_WAIT_VALUE_GEQ = 0x0  # cyclic: (int32)(word - value) >= 0
CUDA_SUCCESS = 0
SELF_TEST_TIMEOUT_US = 2_000_000.0  # the start-up check's watchdog (a failed wait costs at most this)
SELF_TEST_HOLD_S = 0.005  # the start-up check: the stream must still be waiting this long after the wait
FLAG_WORDS = 32  # the words sit in a 128-byte pinned block: the word at 0, the stream's "reached" word at 16
REACHED_INDEX = 16  # 64 bytes from the word: its own cache line
# the watchdog's deadline, from the wait's enqueue: longer than any step the host may legitimately take to
# release, i.e. the previous step's remaining GPU work plus drafting (a chunked-prefill step of a large target
# lasts many decode steps, so a deadline of a few decode steps would fire on it). Only a stream blocked before
# release reaches it.
STALL_TIMEOUT_MS = 2000.0


def _driver() -> tuple[Any, Any, Any] | str:
    """(cuStreamWaitValue32, cuMemHostGetDevicePointer, cuStreamWriteValue32 or None) from libcuda, or why not."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return f"libcuda.so.1 not loadable ({exc})"
    wait = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(lib, "cuStreamWaitValue32", None)
    dptr = getattr(lib, "cuMemHostGetDevicePointer_v2", None) or getattr(lib, "cuMemHostGetDevicePointer", None)
    if wait is None or dptr is None:
        return "the driver has no cuStreamWaitValue32 / cuMemHostGetDevicePointer"
    write = getattr(lib, "cuStreamWriteValue32_v2", None) or getattr(lib, "cuStreamWriteValue32", None)
    for fn in (wait, write):
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
    dptr.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
    dptr.restype = ctypes.c_int
    return wait, dptr, write


class DeviceWait:
    """One pinned sequence word, its watchdog, and the stream wait on it."""

    def __init__(
        self, *, word: Any, flag: Any, device_ptr: int, wait_fn: Any, write_fn: Any, timeout_us: float, grace_us: float
    ) -> None:
        self.word = word  # pinned int32 tensor [FLAG_WORDS]; element 0 the word, REACHED_INDEX the stream's
        self.flag = flag  # specdec._host_flag.Flag
        self.device_ptr = device_ptr
        self._wait, self._write = wait_fn, write_fn  # write_fn None: no grace (the long deadline only)
        self.timeout_us = timeout_us
        self.grace_us = grace_us if write_fn is not None else 0.0
        self.seq = 0

    @classmethod
    def create(cls, device: Any, *, timeout_ms: float, grace_ms: float = 0.0) -> tuple[DeviceWait | None, str]:
        """A working device wait on ``device`` (CUDA), or (None, reason). ``timeout_ms``: the stall bound from
        each wait's enqueue; ``grace_ms`` (> 0): the drafting deadline from the GPU's arrival at the wait."""
        import torch

        if torch.device(device).type != "cuda" or not torch.cuda.is_available():
            return None, "not a CUDA device"
        try:
            from specdec._host_flag import Flag
        except ImportError as exc:
            return None, f"specdec._host_flag is not built ({exc})"
        drv = _driver()
        if isinstance(drv, str):
            return None, drv
        wait_fn, dptr_fn, write_fn = drv
        word = torch.zeros(FLAG_WORDS, dtype=torch.int32, pin_memory=True)
        dptr = ctypes.c_uint64(0)
        rc = dptr_fn(ctypes.byref(dptr), ctypes.c_void_p(word.data_ptr()), 0)
        if rc != CUDA_SUCCESS:
            return None, f"cuMemHostGetDevicePointer failed (CUresult {rc})"
        timeout_us = max(float(timeout_ms), 1.0) * 1000.0
        reached = word[REACHED_INDEX : REACHED_INDEX + 1]
        dw = cls(
            word=word,
            flag=Flag(word.data_ptr(), reached.data_ptr()),
            device_ptr=int(dptr.value),
            wait_fn=wait_fn,
            write_fn=write_fn if grace_ms > 0 else None,
            timeout_us=timeout_us,
            grace_us=float(grace_ms) * 1000.0,
        )
        reason = dw._self_test(torch.device(device))
        if reason:
            dw.close()
            return None, reason
        return dw, ""

    def _self_test(self, device: Any) -> str:
        """The device's current stream (the one vLLM runs on) waits for the word: an event behind the wait must
        still be pending ``SELF_TEST_HOLD_S`` later, and pass once the host stores the word (not the watchdog)."""
        import torch

        stream = torch.cuda.current_stream(device)
        done = torch.cuda.Event()
        seq = self.seq + 1
        try:
            self._wait_on(stream, timeout_us=SELF_TEST_TIMEOUT_US, grace_us=0.0)  # the hold must not be cut short
        except RuntimeError as exc:
            return str(exc)
        done.record(stream)
        time.sleep(SELF_TEST_HOLD_S)
        if done.query():
            self.release(seq)
            return "the stream did not wait for the word"
        if self._write is not None and int(self.word[REACHED_INDEX]) != seq:  # the GPU's arrival went unseen
            logger.info("specdec: the stream's arrival word was not written; the watchdog keeps its long deadline")
            self._write, self.grace_us = None, 0.0
        self.release(seq)
        done.synchronize()
        if self.flag.fired():
            return "the stream wait was released by the watchdog, not by the host"
        return ""

    def usable(self, dst: Any) -> bool:
        """True if a copy into ``dst`` can wait on the device (a CUDA tensor, no graph being captured)."""
        import torch

        return bool(getattr(dst, "is_cuda", False)) and not torch.cuda.is_current_stream_capturing()

    def enqueue_copy(self, dst: Any, src: Any) -> int:
        """On the current stream: wait until the word reaches the next seq, then copy ``src`` (pinned) into
        ``dst``. Returns seq (``release`` it once ``src`` holds the drafts)."""
        import torch

        seq = self._wait_on(torch.cuda.current_stream(dst.device))
        dst.copy_(src, non_blocking=True)
        return seq

    def _wait_on(self, stream: Any, *, timeout_us: float | None = None, grace_us: float | None = None) -> int:
        """Make ``stream`` (torch.cuda.Stream) wait until the word reaches the next seq; arm the watchdog."""
        self.seq += 1
        self.flag.arm(self.seq, timeout_us or self.timeout_us, self.grace_us if grace_us is None else grace_us)
        if self._write is not None:  # the stream marks its arrival at the wait (the watchdog's grace starts there)
            rc = self._write(
                ctypes.c_void_p(stream.cuda_stream), self.device_ptr + 4 * REACHED_INDEX, self.seq & 0xFFFFFFFF, 0
            )
            if rc != CUDA_SUCCESS:
                self._write, self.grace_us = None, 0.0
                logger.info(
                    "specdec: cuStreamWriteValue32 failed (CUresult %d); the watchdog keeps its long deadline", rc
                )
        rc = self._wait(
            ctypes.c_void_p(stream.cuda_stream), self.device_ptr, self.seq & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ
        )
        if rc != CUDA_SUCCESS:
            self.flag.release(self.seq)
            raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {rc})")
        return self.seq

    def release(self, seq: int) -> None:
        """The drafts of ``seq`` are in the pinned buffer: let the stream go on."""
        self.flag.release(seq & 0xFFFFFFFF)

    def fired(self) -> int:
        """Waits the watchdog released: drafting past the grace (``draft_timeout_ms`` after the GPU arrived) or a
        stall (``stalls``)."""
        return int(self.flag.fired())

    def stalls(self) -> int:
        """Of ``fired``, the waits never released by the host within STALL_TIMEOUT_MS (a blocked stream)."""
        return int(self.flag.stalls())

    def close(self) -> None:
        self.flag.release(self.seq & 0xFFFFFFFF)
        self.flag.close()
