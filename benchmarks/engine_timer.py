"""The benchmark's step timers across vLLM's engine-core process (``bench_vllm --engine-process``).

In vLLM's default layout (``vllm serve``, ``LLM()`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=1``) the engine core, its
scheduler and the model runner live in a process of their own; the benchmark's process only adds requests and reads
outputs. ``StepTimer``'s hooks (drafting time, GPU busy time and idle gaps per step, the step trace) must run
there. ``install_local`` installs them in the benchmark's process before ``LLM()`` is built: an engine process
started by fork (vLLM's default while CUDA is untouched) inherits the hooks and the timer. ``EngineTimer`` then
reaches that timer through ``LLM.collective_rpc`` (the one-GPU executor runs it in the engine core's process);
under spawn its first call installs a fresh timer there, after the engine was built (the hooks wrap vLLM's class
methods, looked up per call, and the timer gives itself to the plugin's proposers through the plugin's timing hook,
``specdec.vllm_plugin.observe``, as each measured call starts, so they see every later step).

``collective_rpc`` sends a callable by reference to this module (cloudpickle), which vLLM's serializer allows
only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (``ALLOW_PICKLE_ENV``, set by ``allow_rpc`` before the engine
is built; a benchmark's own processes only)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from benchmarks.step_timer import StepTimer
from benchmarks.step_trace import StepTrace

ALLOW_PICKLE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"
SLOT_COUNTERS = (
    "notes",
    "growth_notes",
    "growth_extra_slots",
    "growth_extra_used",
    "slots_granted",
    "slots_offered",
    "prefill_steps",
    "narrow_steps",
)
NARROW_WIDTH_COUNTER = "narrow_steps_w"  # the slot book's narrow schedules by width: narrow_steps_w6, ...

_timer: StepTimer | None = None  # this process's installed timer (an engine process forked after install_local
# inherits it)


def install_local(trace: bool) -> StepTimer:
    """A ``StepTimer`` (with a ``StepTrace`` if ``trace``) installed in this process, and kept as its timer."""
    global _timer
    _timer = StepTimer(StepTrace() if trace else None)
    _timer.install()
    return _timer


def allow_rpc() -> None:
    """Let ``collective_rpc`` carry this module's functions (set before ``LLM()``: the engine process inherits it)."""
    os.environ[ALLOW_PICKLE_ENV] = "1"


def slot_counters() -> dict[str, int]:
    """The counters of the slot book of this process's proposer (schedule mode, adaptive slots), or {}."""
    from specdec.vllm_plugin.proposer import INSTANCES

    books = [p.scheduled.slot_book for p in list(INSTANCES) if getattr(p, "scheduled", None) is not None]
    book = next((b for b in books if b is not None), None)
    if book is None:
        return {}
    d = book.as_dict()
    return {
        k: int(v) for k, v in d.items() if v is not None and (k in SLOT_COUNTERS or k.startswith(NARROW_WIDTH_COUNTER))
    }


def specdec_stats() -> list[dict[str, Any]]:
    """The stats of every specdec proposer in this process ([] when none was built here)."""
    from specdec.vllm_plugin.proposer import INSTANCES

    return [p.stats() for p in list(INSTANCES)]


def on_engine(worker: Any, action: str, value: Any = None) -> Any:
    """Runs in the engine core's process (``collective_rpc`` passes the ``worker`` first): ``action`` on its
    timer, installed now if the process has none (spawned); ``value``: the trace flag for that install, or the
    ``gpu_on`` value, or the function of ``ENGINE_FUNCTIONS`` to call."""
    del worker  # the timer's hooks are class-level; the worker is not needed
    timer = _timer if _timer is not None else install_local(bool(value) if action == "ensure" else False)
    if action == "ensure":
        return timer.trace is not None
    if action == "gpu_on":
        timer.gpu_on = bool(value)
        return None
    if action == "collect":
        timer.collect_gpu()
        return None
    if action == "counts":
        return timer.counts()
    if action == "trace":
        return timer.take_trace()
    if action == "call":
        return ENGINE_FUNCTIONS[value]()
    raise ValueError(f"on_engine: unknown action {action!r}; valid: ensure, gpu_on, collect, counts, trace, call")


ENGINE_FUNCTIONS: dict[str, Callable[[], Any]] = {"slot_counters": slot_counters, "specdec_stats": specdec_stats}


class EngineTimer:
    """A ``step_timer.CellTimer`` whose timer lives in the engine core's process (see the module docstring);
    ``llm``: vLLM's ``LLM`` (its ``collective_rpc``; one worker: the one-GPU executor)."""

    def __init__(self, llm: Any, *, trace: bool) -> None:
        self._llm = llm
        self._gpu_on = False
        if self._rpc("ensure", trace) != trace:
            raise RuntimeError(
                "engine timer: the engine process's timer has no trace where one was asked for "
                "(or the reverse): install_local and EngineTimer disagree on trace"
            )

    def _rpc(self, action: str, value: Any = None) -> Any:
        out = self._llm.collective_rpc(on_engine, args=(action, value))
        return out[0] if isinstance(out, list) and out else out

    @property
    def gpu_on(self) -> bool:
        return self._gpu_on

    @gpu_on.setter
    def gpu_on(self, on: bool) -> None:
        self._rpc("gpu_on", on)
        self._gpu_on = on

    def collect_gpu(self) -> None:
        self._rpc("collect")

    def counts(self) -> dict[str, float]:
        return dict(self._rpc("counts"))

    def take_trace(self) -> dict[str, list[Any]] | None:
        return self._rpc("trace")

    def call(self, name: str) -> Any:
        """``ENGINE_FUNCTIONS[name]()`` run in the engine core's process."""
        return self._rpc("call", name)


def in_engine(timer: Any, name: str) -> Any:
    """``ENGINE_FUNCTIONS[name]()`` where the engine core runs: through ``timer`` when it is an ``EngineTimer``,
    else here."""
    return timer.call(name) if isinstance(timer, EngineTimer) else ENGINE_FUNCTIONS[name]()
