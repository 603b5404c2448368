"""bench_vllm --engine-process: the step timers live in vLLM's engine-core process and are read through
``collective_rpc`` (``benchmarks.engine_timer``). The engine process is simulated: a fake ``LLM`` whose
``collective_rpc`` sends the callable through cloudpickle (as vLLM's serializer does) and runs it with a worker,
against a timer the test installs as that process's own."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import engine_timer
from benchmarks.step_timer import StepTimer
from benchmarks.step_trace import StepTrace

STEP_S = 0.25  # fake engine: seconds per step on the fake clock


class FakeEngineProcess:
    """vLLM's ``LLMEngine`` as the sustained feed uses it, whose steps run in the "engine process": each step
    counts on that process's timer (what StepTimer's execute_model wrapper does) and drafts for 1 ms; request i
    of prompt [n, ...] finishes after n steps."""

    def __init__(self, timer: StepTimer, clock: list[float]) -> None:
        self.timer, self.clock = timer, clock
        self.running: dict[str, list[Any]] = {}
        self.on_steps: list[bool] = []  # the engine timer's gpu_on at each step

    def add_request(self, request_id: str, prompt: dict, params: object) -> None:
        self.running[request_id] = [prompt["prompt_token_ids"][0], prompt["prompt_token_ids"]]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[Any]:
        self.timer.steps += 1
        self.timer.draft_s += 1e-3
        if self.timer.trace is not None:
            self.timer.trace.step(
                SimpleNamespace(
                    num_scheduled_tokens={r: 1 for r in self.running}, total_num_scheduled_tokens=len(self.running)
                ),
                self.timer.draft_s,
            )
        self.on_steps.append(self.timer.gpu_on)
        self.clock[0] += STEP_S
        outs = []
        for rid, state in list(self.running.items()):
            state[0] -= 1
            outs.append(
                SimpleNamespace(
                    request_id=rid,
                    finished=state[0] == 0,
                    metrics=None,
                    outputs=[SimpleNamespace(token_ids=[t + 100 for t in state[1]])],
                )
            )
            if state[0] == 0:
                del self.running[rid]
        return outs


class FakeLLM:
    """``LLM`` with its engine core elsewhere: ``collective_rpc`` pickles the callable (by reference: the engine
    process imports the same module) and runs it as ``fn(worker, *args)``, one result per worker."""

    def __init__(self, engine: FakeEngineProcess) -> None:
        self.llm_engine, self.calls = engine, []

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = ()) -> list[Any]:
        import cloudpickle

        fn = pickle.loads(cloudpickle.dumps(method))
        self.calls.append(args[0])
        return [fn("worker", *args)]

    def get_metrics(self) -> list[Any]:
        return []


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    from benchmarks import bench_vllm_load

    t = [0.0]
    monkeypatch.setattr(bench_vllm_load.time, "perf_counter", lambda: t[0])
    return t


class BookHolder:
    """Stands for a schedule-mode proposer holding a slot book (what ``engine_timer.slot_counters`` reads)."""

    def __init__(self, book) -> None:
        self.scheduled = SimpleNamespace(slot_book=book)


def test_a_sustained_cell_reads_steps_drafting_and_trace_from_the_engine_process(monkeypatch, clock):
    """The cell's steps, drafting time and trace come from the engine process's timer; its GPU events run only
    during the cell (gpu_on set there before the first step, cleared after the last); the benchmark process's own
    timer (installed before LLM(), as bench_vllm does) sees nothing."""
    from benchmarks.bench_vllm_load import run_sustained

    remote = StepTimer(StepTrace())
    monkeypatch.setattr(engine_timer, "_timer", remote)  # the engine process's timer (inherited by fork)
    engine = FakeEngineProcess(remote, clock)
    llm = FakeLLM(engine)
    timer = engine_timer.EngineTimer(llm, trace=True)
    local = StepTimer()  # the benchmark process's: never stepped
    prompts = [[2, 5], [3, 9], [1, 7]]
    cell = run_sustained(llm, prompts, 2, "sp", timer)
    # step 1: A, B; step 2: A finishes, C joins; step 3: B and C finish
    assert engine.on_steps == [True] * 3 and remote.gpu_on is False and timer.gpu_on is False
    assert cell["engine_steps"] == 3 and cell["draft_ms_per_step"] == pytest.approx(1.0)
    assert cell["wall_s"] == 3 * STEP_S and cell["output_tokens"] == 6
    assert cell["trace"]["reqs"] == [2, 2, 2] and cell["trace"]["draft_ms"][:2] == [1.0, 1.0]
    assert local.counts() == {"steps": 0, "draft_s": 0.0, "gap_ms": 0.0, "busy_ms": 0.0, "gap_n": 0}
    assert llm.calls[:3] == ["ensure", "counts", "gpu_on"] and llm.calls[-3:] == ["collect", "counts", "trace"]
    assert remote.trace is not None and remote.trace.rows == []  # taken by the cell


def test_slot_counters_and_stats_run_where_the_engine_is(monkeypatch, clock):
    """``in_engine`` calls the named engine function through the proxy, or here for an in-process timer."""
    from specdec.vllm_plugin.modes.slots import SlotBook
    from specdec.vllm_plugin.proposer import INSTANCES

    monkeypatch.setattr(engine_timer, "_timer", StepTimer())
    llm = FakeLLM(FakeEngineProcess(StepTimer(), clock))
    book = SlotBook(16, narrow=6, narrow_rows=(16, 48))
    holder = BookHolder(book)
    INSTANCES.add(holder)
    try:
        book.begin_schedule(running=32)
        remote = engine_timer.in_engine(engine_timer.EngineTimer(llm, trace=False), "slot_counters")
        here = engine_timer.in_engine(StepTimer(), "slot_counters")
    finally:
        INSTANCES.discard(holder)
    assert remote == here and remote["narrow_steps"] == 1 and remote["narrow_steps_w6"] == 1
    assert llm.calls == ["ensure", "call"]


def test_a_spawned_engine_process_installs_its_timer_at_the_first_call(monkeypatch):
    """No inherited timer (the engine process was spawned): the first call installs one, with a trace if asked;
    a proxy whose trace flag disagrees with the engine's timer is refused; unknown actions name the valid ones."""
    installed: list[StepTimer] = []
    monkeypatch.setattr(StepTimer, "install", lambda self: installed.append(self))
    monkeypatch.setattr(engine_timer, "_timer", None)
    assert engine_timer.on_engine("worker", "ensure", True) is True
    assert len(installed) == 1 and engine_timer._timer is installed[0] and installed[0].trace is not None
    assert engine_timer.on_engine("worker", "ensure", True) is True and len(installed) == 1  # installed once
    llm = FakeLLM(FakeEngineProcess(StepTimer(), [0.0]))
    with pytest.raises(RuntimeError, match="trace"):
        engine_timer.EngineTimer(llm, trace=False)
    with pytest.raises(ValueError, match="unknown action 'reset'.*counts"):
        engine_timer.on_engine("worker", "reset")


def test_the_rpc_passes_vllms_serializer_only_when_pickling_is_allowed(monkeypatch):
    """On a real vLLM (CI's vLLM venv): vLLM's msgpack encoder carries ``on_engine`` to the engine process only with
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 (``allow_rpc``), and the decoded callable runs there."""
    serial = pytest.importorskip("vllm.v1.serial_utils")
    monkeypatch.delenv(engine_timer.ALLOW_PICKLE_ENV, raising=False)
    message = ("collective_rpc", engine_timer.on_engine, None, ("counts", None), None)
    with pytest.raises(TypeError, match="VLLM_ALLOW_INSECURE_SERIALIZATION"):
        serial.MsgpackEncoder().encode(message)
    monkeypatch.setenv(engine_timer.ALLOW_PICKLE_ENV, "1")  # what allow_rpc sets (the test restores it)
    decoded = serial.MsgpackDecoder().decode(serial.MsgpackEncoder().encode(message))
    timer = StepTimer()
    timer.steps = 7
    monkeypatch.setattr(engine_timer, "_timer", timer)
    method, args = decoded[1], tuple(decoded[3])
    assert serial.run_method("worker", method, args, {})["steps"] == 7
