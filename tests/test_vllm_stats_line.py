"""The plugin's statistics line (``core/reporting.py``): the periodic line, the line with the totals when the engine
goes idle (``SpecdecProposer.note_idle`` from both ``execute_model`` hooks) and at close or exit, never the same
totals twice; driven by ``test_vllm_backoff``'s forced-acceptance batches on the Python engine."""

from __future__ import annotations

import logging
import weakref
from types import SimpleNamespace

import pytest

from specdec.drafters.suffix import SuffixDrafter, native_available
from specdec.vllm_plugin.core.backoff import MIN_STEPS
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.patches import async_sched, runner
from specdec.vllm_plugin.patches.table import PatchReport
from specdec.vllm_plugin.proposer import SpecdecProposer
from test_vllm_backoff import MAX_LEN, ROWS, Batch, K, handed, make_core, never

pytestmark = pytest.mark.skipif(not native_available(), reason="native suffix core not built")


def test_the_periodic_log_line_counts_back_offs_recoveries_and_newcomers(plugin_log, caplog):
    """The statistics line (``log_every_s``) says what the back-off did so far: what a low-acceptance server's log
    must show to explain its drafted steps."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    batch = Batch()
    core = make_core("python", batch.clock, log_every_s=0.05)
    handed(batch, core, "python", range(200), never)
    lines = [r.getMessage() for r in plugin_log() if "requests backed off" in r.getMessage()]
    want = (
        f"{ROWS} requests backed off (low acceptance; {ROWS} back-offs, 0 recoveries, 0 newcomers held so far; "
        f"verified drafted steps {ROWS * MIN_STEPS} before any back-off, 0 after a recovery; 0 steps gated)"
    )
    assert lines and want in lines[-1]
    assert lines[-1].endswith(", batch not padded")
    core.close()


def test_the_statistics_line_once_more_with_the_totals_at_close_or_exit(plugin_log, caplog):
    """A run shorter than ``log_every_s`` (a benchmark, a short server) still leaves its totals in the log: one final
    line when the core closes or the process exits, whichever comes first; none with ``log_every_s`` 0."""
    from benchmarks.gate_metrics import plugin_line
    from specdec.vllm_plugin.core.reporting import _log_final_if_alive

    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    batch = Batch()
    core = make_core("python", batch.clock)  # log_every_s 60: no periodic line in these 200 steps of 1 ms
    handed(batch, core, "python", range(200), never)
    steps = core.stats.steps
    assert not [r for r in plugin_log() if "requests backed off" in r.getMessage()]
    _log_final_if_alive(weakref.WeakMethod(core.log_final))  # what the exit hook runs
    core.close()  # after the exit hook: not again
    lines = [r.getMessage() for r in plugin_log() if "requests backed off" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"specdec: final: {steps} steps (")
    assert f"{ROWS} back-offs" in lines[0]
    got = plugin_line(lines[0])  # what the GPU gate reads back from a server's log
    want = {"steps": steps, "drafted_steps": core.stats.drafted_steps, "drafted": core.stats.drafted_tokens}
    want |= {"back_offs": ROWS, "outcomes_first": core.backoff.stats.outcomes_first, "outcomes_recovered": 0}
    want |= {"gated_steps": core.backoff.stats.gated_steps}
    assert got is not None and {k: got[k] for k in want} == want
    quiet = make_core("python", batch.clock, log_every_s=0.0)
    handed(batch, quiet, "python", range(200, 210), never)
    quiet.close()
    dead = weakref.WeakMethod(quiet.log_final)
    del quiet
    _log_final_if_alive(dead)  # the core is gone: nothing to log, nothing raised
    assert len([r for r in plugin_log() if "requests backed off" in r.getMessage()]) == 1


IDLE = SimpleNamespace(total_num_scheduled_tokens=0)  # vLLM's step after its last requests finished
BUSY = SimpleNamespace(total_num_scheduled_tokens=ROWS)


def make_proposer(**opts) -> SpecdecProposer:
    """A drafting rank's proposer (synchronous drafting) on a fake vLLM config."""
    cfg = SimpleNamespace(
        additional_config={"specdec": {"draft_timeout_ms": 0.0, "async_drafting": False, **opts}},
        speculative_config=SimpleNamespace(num_speculative_tokens=K),
        model_config=SimpleNamespace(max_model_len=MAX_LEN),
    )
    drafter = SuffixDrafter(backend="native")
    return SpecdecProposer(cfg, drafter=drafter, patch_runner=False, patches=PatchReport("test"))


def stat_lines(plugin_log) -> list[str]:
    return [r.getMessage() for r in plugin_log() if "requests backed off" in r.getMessage()]


def test_the_engine_going_idle_logs_the_totals_once(plugin_log, caplog):
    """A step that schedules no token (the engine goes idle) logs the totals once; again only after more steps; a busy
    step logs nothing; the exit line does not repeat the idle line's totals."""
    from benchmarks.gate_metrics import plugin_line
    from specdec.vllm_plugin.core.reporting import _log_final_if_alive

    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    batch, prop = Batch(), make_proposer()  # log_every_s 60: no periodic line in these steps of 1 ms
    core = prop.core
    assert core is not None
    core.clock = batch.clock  # the core started on perf_counter: no periodic line on this clock
    handed(batch, core, "python", range(30), never)
    prop.note_idle(BUSY)
    assert stat_lines(plugin_log) == []
    g = prop.graph_stats  # what the engine's dispatcher counted (shared through the config)
    g.narrow_full, g.plain_full, g.narrow_piecewise, g.ragged_full, g.ragged_piecewise = 7, 5, 3, 2, 1
    prop.note_idle(IDLE)
    prop.note_idle(IDLE)  # vLLM's next empty step, or the other execute_model hook: nothing new, nothing logged
    lines = stat_lines(plugin_log)
    assert len(lines) == 1 and lines[0].startswith("specdec: idle: 30 steps (")
    graphs = [r.getMessage() for r in plugin_log() if r.getMessage().startswith("specdec: idle graphs")]
    assert graphs == [
        "specdec: idle graphs: plain 5 and narrow 2 steps on FULL graphs, 3 on piecewise; ragged 2 FULL (0 with "
        "prompt chunks), 1 piecewise"
    ]
    got = plugin_line(lines[0])
    assert got is not None and (got["steps"], got["drafted"]) == (30, core.stats.drafted_tokens)
    handed(batch, core, "python", range(30, 40), never)
    prop.note_idle(BUSY)
    prop.note_idle(IDLE)
    lines = stat_lines(plugin_log)
    assert len(lines) == 2 and lines[1].startswith("specdec: idle: 40 steps (")
    _log_final_if_alive(weakref.WeakMethod(core.log_final))  # the exit hook: the same totals, not again
    prop.close()
    assert len(stat_lines(plugin_log)) == 2


def test_no_idle_line_without_log_every_s_nor_on_a_rank_without_a_core(plugin_log, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    batch, quiet = Batch(), make_proposer(log_every_s=0.0)
    assert quiet.core is not None
    handed(batch, quiet.core, "python", range(10), never)
    quiet.note_idle(IDLE)
    quiet.close()
    monkeypatch.setattr("specdec.vllm_plugin.proposer._tp_rank", lambda: 1)
    follower = make_proposer()
    assert follower.core is None
    follower.note_idle(IDLE)
    follower.close()
    assert stat_lines(plugin_log) == []


def test_the_last_line_s_totals_are_not_repeated_whichever_line_it_was(plugin_log, caplog):
    """A periodic line counts as the last line too: an idle step or the exit right after it logs nothing; the periodic
    line then counts ``log_every_s`` from the idle line."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    batch = Batch()
    core = make_core("python", batch.clock, log_every_s=1.0)
    handed(batch, core, "python", range(10), never)
    batch.t += 1.0  # the next step is past log_every_s: its periodic line
    handed(batch, core, "python", range(10, 11), never)
    assert [line.split(" (")[0] for line in stat_lines(plugin_log)] == ["specdec: 11 steps"]
    assert not core.log_idle()
    core.log_final()
    handed(batch, core, "python", range(11, 12), never)
    assert core.log_idle()
    batch.t += 0.5
    handed(batch, core, "python", range(12, 13), never)  # 0.5 s after the idle line, 1.5 s after the periodic one
    core.close()
    heads = [line.split(" (")[0] for line in stat_lines(plugin_log)]
    assert heads == ["specdec: 11 steps", "specdec: idle: 12 steps", "specdec: final: 13 steps"]


def test_both_execute_model_hooks_log_one_idle_line_and_never_fail_a_step(plugin_log, caplog):
    """The thread hand-off's and schedule mode's ``execute_model`` hooks (both applied, nested as the table nests
    them) log one idle line for an idle step, before vLLM's method; a failing line is logged once, never raised."""
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    calls: list[object] = []

    def execute_model(self, scheduler_output):  # vLLM's method: the idle line is logged before it runs
        calls.append((scheduler_output, len(stat_lines(plugin_log))))
        return "output"

    wrapped = async_sched.wrap_execute(runner.wrap_execute(execute_model, None), None)
    batch, prop = Batch(), make_proposer()
    fake_runner = SimpleNamespace(drafter=prop, use_async_scheduling=False)
    handed(batch, prop.core, "python", range(5), never)
    assert wrapped(fake_runner, BUSY) == wrapped(fake_runner, IDLE) == "output"
    assert calls == [(BUSY, 0), (IDLE, 1)]
    assert stat_lines(plugin_log)[0].startswith("specdec: idle: 5 steps (")
    assert wrapped(SimpleNamespace(drafter=object()), IDLE) == "output"  # not our proposer: a pass-through

    def broken() -> bool:
        raise RuntimeError("no line")

    handed(batch, prop.core, "python", range(5, 6), never)
    prop.core.log_idle = broken
    assert wrapped(fake_runner, IDLE) == wrapped(fake_runner, IDLE) == "output"
    warnings = [r for r in plugin_log() if "idle statistics line failed" in r.getMessage()]
    assert len(warnings) == 1
    prop.close()
