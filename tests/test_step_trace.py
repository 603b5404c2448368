"""The benchmark's per-step trace: records, GPU attachment, width buckets (hand-checked numbers)."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import step_trace
from benchmarks.step_trace import StepTrace, summarise_trace


def _sched(widths: dict[str, int], spec: dict[str, list[int]] | None = None) -> SimpleNamespace:
    return SimpleNamespace(
        num_scheduled_tokens=widths,
        total_num_scheduled_tokens=sum(widths.values()),
        scheduled_spec_decode_tokens=spec or {},
    )


def test_trace_records_periods_drafting_graph_modes_and_gpu(monkeypatch):
    clock = iter([0.0, 0.004, 0.010, 0.012])
    monkeypatch.setattr(step_trace.time, "perf_counter", lambda: next(clock))
    tr = StepTrace()
    tr.step(_sched({"a": 3, "b": 3}, {"a": [5, 6], "b": [7, 8]}), draft_s_total=0.0)
    tr._cg = "F"  # what the dispatcher wrapper notes during the forward pass
    tr.emitted([[5, 6, 1], [7, 2]])  # step 0: a accepted 2 drafts + bonus, b 1 + bonus
    tr.step(second := _sched({"a": 1}), draft_s_total=0.001)  # 1 ms of drafting during step 0's period
    tr._cg = "P"
    tr.step(_sched({"a": 2}, {"a": [9]}), draft_s_total=0.0015)
    tr.emitted([[4]], second)  # async scheduling: step 1's update arrives after step 2 started
    tr.end_call(0.0025, {0: (0.5, 1.0), 1: (0.3, 0.2), 2: (0.4, None)})
    tr.step(_sched({"c": 1}), draft_s_total=0.0025)  # a second generate call: new step, no GPU record
    tr.end_call(0.0025, {})
    cell = tr.cell()
    assert cell["reqs"] == [2, 1, 1, 1]
    assert cell["tokens"] == [6, 1, 2, 1]
    assert cell["spec"] == [4, 0, 1, 0]
    assert cell["emitted"] == [5, 1, None, None]
    assert cell["period_ms"] == pytest.approx([4.0, 6.0, None, None])  # last step of each call: no next step
    assert cell["draft_ms"] == pytest.approx([1.0, 0.5, 1.0, 0.0])
    assert cell["cg"] == "FP??"
    assert cell["busy_ms"] == [0.5, 0.3, 0.4, None] and cell["gap_ms"] == [1.0, 0.2, None, None]
    assert tr.cell()["reqs"] == []  # cleared


def test_a_step_the_plugin_dispatched_to_its_own_full_graph_is_full(monkeypatch):
    """The plugin's narrow and ragged keys are dispatched by its wrapper, which the mode-noting wrapper does not
    see: a step during which its FULL count grew is "F", one without stays "?"."""
    from specdec.vllm_plugin.patches.graph_stats import GraphStats

    stats = GraphStats(ragged_full=10)  # the engine's counts, as its dispatcher wrapper keeps them
    tr = StepTrace(stats.full_dispatches)
    tr.step(_sched({"a": 3}), draft_s_total=0.0)
    stats.ragged_full += 1  # the forward pass replays a ragged graph
    tr.step(_sched({"a": 2}), draft_s_total=0.0)
    tr._cg = "P"
    tr.step(_sched({"a": 1}), draft_s_total=0.0)
    stats.ragged_prefill_full += 1  # a ragged batch with a prompt chunk (the second family)
    tr.step(_sched({"a": 2}), draft_s_total=0.0)
    tr.end_call(0.0, {})
    assert tr.cell()["cg"] == "FPF?"  # (a count that grows after a step marks that step)


def test_summary_groups_steps_by_width_and_shares_the_wall():
    trace = {
        "reqs": [64, 64, 40, 3, 1],
        "tokens": [1088, 1088, 680, 51, 17],
        "spec": [1024, 1024, 640, 48, 16],
        "period_ms": [5.0, 5.0, 4.0, 2.0, None],
        "draft_ms": [1.0, 1.0, 0.5, 0.1, 0.1],
        "busy_ms": [1.5, 1.5, 1.0, 0.5, 0.5],
        "gap_ms": [3.5, 3.5, 3.0, 1.5, None],
        "cg": "FFPNF",
    }
    rows = {r["width"]: r for r in summarise_trace(trace)}
    assert list(rows) == ["49-64", "33-48", "3-4", "1"]  # widest first
    assert rows["49-64"]["steps"] == 2 and rows["49-64"]["wall_share"] == pytest.approx(10 / 16)
    assert rows["49-64"]["period_ms_mean"] == pytest.approx(5.0) and rows["49-64"]["not_full_share"] == 0.0
    assert rows["33-48"]["not_full_share"] == 1.0 and rows["3-4"]["not_full_share"] == 1.0
    assert rows["1"]["period_ms_mean"] is None and rows["1"]["gap_ms_mean"] is None
    assert rows["49-64"]["emitted_mean"] is None  # older traces have no emitted column
    assert "| 49-64 | 2 | 0.62 |" in step_trace.format_rows(summarise_trace(trace))


def test_step_cost_fit_recovers_a_known_line_and_skips_prefill_and_narrow_steps():
    from benchmarks.step_trace import fit_step_cost

    emitted = [64, 100, 150, 200, 260, 300, 380, 450, 500, 640]
    trace = {
        "reqs": [64] * 10 + [64, 8],
        "tokens": [64 + 1024] * 10 + [9000, 8 + 128],
        "spec": [1024] * 10 + [0, 128],
        "emitted": emitted + [64, 40],
        "period_ms": [3.0 + 0.006 * e for e in emitted] + [20.0, 9.0],  # 3 ms + 6 us per token
        "draft_ms": [0.2 + 0.002 * e for e in emitted] + [5.0, 5.0],
    }
    fit = fit_step_cost([trace], min_width=48)
    assert fit is not None and fit["steps"] == 10  # the prefill step and the 8-wide step are left out
    assert fit["period_ms"] == pytest.approx(3.0) and fit["period_us_per_token"] == pytest.approx(6.0)
    assert fit["draft_ms"] == pytest.approx(0.2) and fit["draft_us_per_token"] == pytest.approx(2.0)
    assert fit["r2"] == pytest.approx(1.0)
    assert fit["tokens_per_s"] == pytest.approx(1e3 * sum(emitted) / sum(3.0 + 0.006 * e for e in emitted))
    assert fit_step_cost([{**trace, "emitted": [None] * 12}], min_width=48) is None  # older traces
    plain = fit_step_cost([{**trace, "spec": [0] * 12, "tokens": [64] * 10 + [9000, 8]}], min_width=48)
    assert plain is not None and plain["period_us_per_token"] is None
    assert plain["period_ms"] == pytest.approx(sum(trace["period_ms"][:10]) / 10)


@pytest.mark.vllm  # needs vLLM: run by scripts/test.sh against each tested vLLM
def test_timer_and_trace_hooks_keep_vllm_signatures(monkeypatch):
    """On a real vLLM (CI's vLLM venv): the wrapped runner, dispatcher and scheduler methods keep their signatures
    (the plugin's runner patch checks them)."""
    vllm_runner = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    import inspect

    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

    from benchmarks.step_timer import StepTimer

    runner = vllm_runner.GPUModelRunner
    names = [(runner, n) for n in ("execute_model", "propose_draft_token_ids", "_model_forward", "_bookkeeping_sync")]
    names += [(runner, "sample_tokens"), (Scheduler, "schedule")]
    names += [(CudagraphDispatcher, "dispatch"), (Scheduler, "update_from_output")]
    from benchmarks.step_timer import v2_runner

    v2 = v2_runner()  # Model Runner V2 (no speculation's): steps and host phases where this vLLM has it
    names += [(v2, n) for n in ("execute_model", "sample_tokens")] if v2 is not None else []
    before = {}
    for owner, name in names:
        before[(owner, name)] = inspect.signature(getattr(owner, name))
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    from specdec.vllm_plugin.modes.device_wait import DeviceWait
    from specdec.vllm_plugin.modes.schedule import ScheduledDrafting

    drafting, wait = dict(vars(ScheduledDrafting)), dict(vars(DeviceWait))
    from specdec.vllm_plugin.patches import async_slots

    for name in ("regrant_placeholders", "cap_prefill_steps"):
        monkeypatch.setattr(async_slots, name, getattr(async_slots, name))
    timer = StepTimer(StepTrace())
    timer.install()
    for owner, name in names:
        fn = getattr(owner, name)
        assert hasattr(fn, "__wrapped__") and inspect.signature(fn) == before[(owner, name)]
    assert runner._bookkeeping_sync.__wrapped__ is not None  # GPU events mark each step's end there
    if v2 is not None:  # no speculation's steps on V2 are counted as V1's are (an engine runs one of the two)
        stub = SimpleNamespace()
        monkeypatch.setattr(StepTimer, "install", StepTimer.install)
        v2_calls: list[Any] = []
        monkeypatch.setattr(v2, "execute_model", lambda self, so, *a, **kw: v2_calls.append(so) or "ran")
        counted = StepTimer()
        counted.install()
        assert v2.execute_model(stub, "step") == "ran" and v2_calls == ["step"] and counted.steps == 1
    assert dict(vars(ScheduledDrafting)) == drafting and dict(vars(DeviceWait)) == wait  # timed by the plugin's hook


class FakeEvent:
    """A CUDA event stand-in: ``t`` ms on the GPU's clock."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, other: FakeEvent) -> float:
        return other.t - self.t

    def synchronize(self) -> None:
        pass


def test_gap_split_at_the_next_steps_wait_event_and_host_times_of_that_step():
    """Step 0 ends at 10 ms, step 1's wait is passed at 10.8 ms and its forward starts at 11.0 ms: the gap after
    step 0 (1.0 ms) = 0.8 held + 0.2 after; the host's drafting times recorded during step 1 go to step 0's gap."""
    from benchmarks.step_timer import StepTimer

    trace = StepTrace()
    timer = StepTimer(trace)
    for _ in range(3):
        trace.step(object(), 0.0)
    timer.events = [
        (FakeEvent(0.0), FakeEvent(10.0), 0),
        (FakeEvent(11.0), FakeEvent(20.0), 1),
        (FakeEvent(20.5), FakeEvent(30.0), 2),
    ]
    timer.held_events = {1: FakeEvent(10.8)}  # step 2 had no device wait (e.g. a host fill)
    timer.host_split = {1: {"sync_ms": 9.5, "finish_ms": 10.1}, 2: {"sync_ms": 0.1}}
    timer.collect_gpu()
    cell = trace.cell()
    assert cell["gap_ms"] == [1.0, 0.5, None]
    assert cell["held_ms"][0] == pytest.approx(0.8) and cell["after_ms"][0] == pytest.approx(0.2)
    assert cell["sync_ms"] == [9.5, 0.1, None] and cell["finish_ms"] == [10.1, None, None]
    assert cell["held_ms"][1] is None and cell["after_ms"][1] is None
    assert timer.held_events == {} and timer.host_split == {}


def test_host_late_share_counts_steps_whose_tokens_were_ready():
    from benchmarks.step_trace import HOST_LATE_SYNC_MS, host_late_share

    trace = {"sync_ms": [5.0, HOST_LATE_SYNC_MS / 2, None, 0.0, 2.0]}
    assert host_late_share(trace) == pytest.approx(2 / 4)  # None: a step without drafting is left out
    assert host_late_share({"reqs": [1, 2]}) is None and host_late_share({"sync_ms": [None]}) is None


def test_host_phases_are_timed_into_the_period_they_ran_in(monkeypatch):
    """The engine loop's phases: ``schedule`` of step 1 runs in step 0's period (before step 1's ``execute_model``),
    ``sample_tokens`` and ``update_from_output`` after it in step 1's; each phase's wall time lands in its row,
    the plugin's slot re-grant inside the schedule column; nothing is recorded outside a measured call."""
    from benchmarks import step_timer
    from benchmarks.bench_vllm_load import _with_split
    from benchmarks.step_timer import StepTimer
    from specdec.vllm_plugin.patches import async_slots

    clock = [0.0]
    monkeypatch.setattr(step_timer.time, "perf_counter", lambda: clock[0])

    def takes(ms: float):
        def fn(*a, **kw):
            clock[0] += ms / 1e3

        return fn

    class Runner:
        execute_model, sample_tokens = takes(3.0), takes(1.0)

    class Scheduler:
        schedule, update_from_output = takes(2.0), takes(0.5)

    monkeypatch.setattr(async_slots, "regrant_placeholders", takes(0.25))
    trace = StepTrace()
    timer = StepTimer(trace)
    timer._install_phases([Runner], Scheduler)
    Scheduler.schedule(None)  # gpu_on is False: not recorded
    timer.gpu_on = True
    for _ in range(2):
        async_slots.regrant_placeholders(None, None)
        Scheduler.schedule(None)
        trace.step(object(), 0.0)  # what the real execute_model wrapper does at entry
        Runner.execute_model(None)
        Runner.sample_tokens(None)
        Scheduler.update_from_output(None)
    timer.collect_gpu()
    cell = trace.cell()
    trace.step(object(), 0.0)  # the next generate call: its phases land in the new book
    Runner.sample_tokens(None)
    assert timer.host_phase == {0: {"sample_ms": pytest.approx(1.0)}}
    assert cell["sched_ms"] == [pytest.approx(2.25), None]  # step 1's schedule ran in step 0's period
    assert cell["exec_ms"] == [pytest.approx(3.0)] * 2 and cell["sample_ms"] == [pytest.approx(1.0)] * 2
    assert cell["update_ms"] == [pytest.approx(0.5)] * 2
    cell["period_ms"] = [7.0, None]
    means = _with_split(cell)["host_phase_ms"]  # steps with a measured period only
    assert means == {
        "period_ms": 7.0,
        "sched_ms": pytest.approx(2.25),
        "exec_ms": pytest.approx(3.0),
        "sample_ms": pytest.approx(1.0),
        "update_ms": pytest.approx(0.5),
    }
    untimed = {**cell, **{col: [None, None] for col in ("sched_ms", "exec_ms", "sample_ms", "update_ms")}}
    assert "host_phase_ms" not in _with_split(untimed)  # a trace whose phases were never timed: no zeros reported


def test_cell_totals_sum_gpu_time_and_split_heavy_prefill_steps(capsys, tmp_path):
    """--totals: busy and idle seconds over every step (untimed steps skipped), and heavy prefill steps (prompt
    tokens = tokens - requests - drafts >= 512) against the rest, by hand."""
    trace = {  # 4 steps: a decode step, a heavy prefill step (600 prompt tokens), a light prefill (100), untimed
        "reqs": [4, 5, 5, 4],
        "tokens": [12, 613, 113, 4],
        "spec": [8, 8, 8, 0],
        "emitted": [10, 5, 9, 4],
        "busy_ms": [10.0, 40.0, 12.0, None],
        "gap_ms": [1.0, 2.0, 0.5, None],
    }
    t = step_trace.cell_totals(trace)
    assert t["steps"] == 4 and t["emitted"] == 28
    assert t["busy_s"] == pytest.approx(0.062) and t["gap_s"] == pytest.approx(0.0035)
    assert t["gpu_s"] == pytest.approx(0.0655)
    assert t["heavy_share"] == 0.25 and t["heavy_emitted"] == 5 and t["heavy_spec"] == 8
    assert t["light_emitted"] == pytest.approx((10 + 9 + 4) / 3) and t["light_busy_ms"] == pytest.approx(11.0)
    assert t["heavy_busy_ms"] == 40.0
    table = step_trace.format_totals({"m ds 4": t})
    assert "| m ds 4 | 4 | 0.06 | 0.00 | 0.07 | 0.25 | 5.0, 7.7 | 8 | 40.0, 11.0 |" in table
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"summary": {"traces": {"m|ds|4": trace}}}))
    step_trace.main([str(path), "--totals"])
    out = capsys.readouterr().out
    assert "| m ds 4 | 4 |" in out and "width" not in out  # only the totals table


def test_the_timer_takes_schedule_modes_drafting_through_the_plugins_hook():
    """``StepTimer`` is the plugin's drafting observer (``specdec.vllm_plugin.observe``): the capture, the fill and a
    deferred fill's drafting count as drafting time; the drafting and its reading of the tokens go to the split."""
    from benchmarks.step_timer import StepTimer
    from specdec.vllm_plugin.observe import PHASE_CAPTURE, PHASE_FILL, PHASE_FINISH, PHASE_TOKENS, PHASE_WAIT

    trace = StepTrace(full_dispatches=lambda: 0)
    timer = StepTimer(trace)
    trace.step(object(), 0.0)
    timer.drafting_phase(PHASE_TOKENS, 0.5)  # outside a measured call: no split
    timer.drafting_phase(PHASE_WAIT, 0.5)  # (no event outside a measured call), never drafting time
    assert timer.host_split == {} and timer.draft_s == 0.0
    timer.gpu_on = True  # a measured call: the hook is given to this process's proposers
    for phase, seconds in ((PHASE_CAPTURE, 0.001), (PHASE_FILL, 0.002), (PHASE_TOKENS, 0.004), (PHASE_FINISH, 0.008)):
        timer.drafting_phase(phase, seconds)
    timer.gpu_on = False
    assert timer.draft_s == pytest.approx(0.011)
    assert timer.host_split[0] == pytest.approx({"sync_ms": 4.0, "finish_ms": 8.0})


def _assigned_attributes(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(object name, attribute, line) of every ``name.attr = ...`` and ``setattr(name, "attr", ...)`` in ``tree``."""
    out = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name):
                out.append((t.value.id, t.attr, node.lineno))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            obj, name = (node.args + [None, None])[:2]
            if isinstance(obj, ast.Name) and isinstance(name, ast.Constant) and isinstance(name.value, str):
                out.append((obj.id, name.value, node.lineno))
    return out


def _imported_from(tree: ast.AST, package: str) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
            names |= {a.asname or a.name for a in node.names}
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == package}
    return names


def test_benchmarks_time_the_plugin_through_its_hook_not_its_privates():
    """No benchmark assigns an attribute of anything it imports from specdec (the plugin's methods, functions,
    classes: its timing hook, ``observe``, is the way in), nor a private (``_``) attribute of anything it imports
    from vLLM."""
    bad = []
    for path in sorted(Path("benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        ours, vllm = _imported_from(tree, "specdec"), _imported_from(tree, "vllm")
        for obj, attr, line in _assigned_attributes(tree):
            if obj in ours or (obj in vllm and attr.startswith("_")):
                bad.append(f"{path}:{line}: {obj}.{attr}")
    assert bad == []


def test_draft_split_compares_drafted_decode_steps_with_plain_ones_and_leaves_prefill_out():
    from benchmarks.step_trace_stats import format_draft_split, summarise_by_draft

    trace = {
        "reqs": [16, 16, 16, 16, 16, 1],
        "tokens": [16, 19, 16, 20, 16 + 256, 4],  # plain, drafted (3), plain, drafted (4), a prompt chunk, narrow
        "spec": [0, 3, 0, 4, 0, 3],
        "period_ms": [5.0, 7.0, 6.0, 8.0, 20.0, None],
        "busy_ms": [4.0, 4.4, 4.0, 4.6, 15.0, 1.0],
        "gap_ms": [1.0, 2.6, 2.0, 3.4, 5.0, None],
        "cg": "FFFPFF",
    }
    rows = {r["kind"]: r for r in summarise_by_draft(trace)}
    plain, drafted = rows["plain"], rows["drafted"]
    assert plain["steps"] == 2 and drafted["steps"] == 2  # the prefill step and the 1-wide step are not counted
    assert plain["period_ms_mean"] == pytest.approx(5.5) and drafted["period_ms_mean"] == pytest.approx(7.5)
    assert drafted["busy_ms_mean"] == pytest.approx(4.5) and drafted["spec_mean"] == pytest.approx(3.5)
    assert plain["next_period_ms_mean"] == pytest.approx((7.0 + 8.0) / 2)  # the steps after the plain ones
    assert drafted["next_period_ms_mean"] == pytest.approx((6.0 + 20.0) / 2)
    assert drafted["not_full_share"] == 0.5 and plain["held_ms_mean"] is None  # a column the trace lacks
    table = format_draft_split(list(rows.values()))
    assert "| drafted / plain | | | | 1.36x | 1.12x |" in table  # period 7.5 / 5.5, busy 4.5 / 4.0
