"""The patch table (``specdec.vllm_plugin.patches.table``): every row's fallback, whole features, the start-up line,
a vLLM outside the tested span; and the plugin's import graph (no cycles, every module importable alone)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest

from import_support import MODULES as PACKAGE_MODULES
from import_support import find_cycle, imports_of
from specdec.vllm_plugin.attrs import PROPOSER_MARK
from specdec.vllm_plugin.patches import table
from specdec.vllm_plugin.patches.common import is_wrapped
from specdec.vllm_plugin.patches.features import ANY_VLLM, Feature
from specdec.vllm_plugin.patches.table import TABLE, PatchReport, apply_patches, apply_row

TESTED = "0.26.0"


class Empty:
    """A vLLM class of another shape: none of the methods the patches wrap."""


def empty_resolver(target: str):
    return SimpleNamespace() if ":" not in target else type("Empty", (Empty,), {})


@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_every_row_falls_back_on_a_vllm_of_another_shape(row):
    """Each row's check refuses a target without the methods it wraps, and nothing is patched (its fallback runs)."""
    target = empty_resolver(row.target)
    before = dict(vars(target))
    why = apply_row(row, in_span=True, resolver=lambda t: target)
    assert why and dict(vars(target)) == before
    assert row.feature.fallback and row.check and row.method


def test_one_row_per_wrapped_method_and_features_are_an_enum():
    """Each row wraps one vLLM method for one feature (a method wrapped for two features has two rows), every
    feature is a ``Feature`` with a name and a fallback, and every feature of the enum has rows."""
    keys = [(r.target, r.method, r.feature) for r in TABLE]
    assert len(set(keys)) == len(TABLE) and len({r.name for r in TABLE}) == len(TABLE)
    assert all(isinstance(r.feature, Feature) and r.method.split(".")[-1].isidentifier() for r in TABLE)
    assert {r.feature for r in TABLE} == set(Feature)
    assert all(f.label and f.fallback for f in Feature) and len({f.label for f in Feature}) == len(Feature)
    by_method = {}
    for r in TABLE:
        by_method.setdefault((r.target, r.method), []).append(r.feature)
    shared = {m: fs for m, fs in by_method.items() if len(fs) > 1}
    assert shared == {
        (table.RUNNER, "propose_draft_token_ids"): [Feature.REQUEST_IDS, Feature.SCHEDULE],
        (table.RUNNER, "execute_model"): [Feature.THREAD_HAND_OFF, Feature.SCHEDULE],
    }  # nested in table order: schedule mode's wrappers outside


def test_a_feature_is_off_when_the_feature_it_needs_is_off():
    """Ragged graphs work through the narrow graphs' dispatcher: a dispatcher of another shape turns both off,
    and no ragged wrapper is installed."""

    class Runner:
        def _build_attention_metadata(self, *, max_query_len):
            """max_query_len=max_query_len"""

        def _check_and_update_cudagraph_mode(self, attention_backends, kv_cache_groups):
            """initialize_cudagraph_keys"""

    rows = tuple(r for r in TABLE if r.feature in (Feature.NARROW_GRAPHS, Feature.RAGGED_GRAPHS))
    runner = type("R", (Runner,), {})
    report = apply_patches("all", version=TESTED, resolver=lambda t: runner if t == table.RUNNER else Empty, table=rows)
    assert not report.on(Feature.NARROW_GRAPHS) and not report.on(Feature.RAGGED_GRAPHS)
    assert report.features()[Feature.RAGGED_GRAPHS] == "needs narrow graphs"
    assert "_build_attention_metadata" not in vars(runner)


def test_a_missing_vllm_module_is_a_fallback_never_an_error():
    def missing(target):
        raise ImportError(target)

    report = apply_patches("all", version=TESTED, resolver=missing)
    assert set(report.rows) == {r.name for r in TABLE}
    assert all(why for why in report.rows.values())
    assert report.line().startswith(f"specdec: 0/{len(TABLE)} vLLM patches applied (vLLM {TESTED}); features on: none")


class Runner:
    """Fits the thread-mode rows: ``take_draft_token_ids`` and ``execute_model`` as vLLM 0.26 has them."""

    def propose_draft_token_ids(self, scheduler_output, sampled):
        return None

    def take_draft_token_ids(self):
        return None

    def _get_draft_token_ids_cpu(self):
        return None

    def execute_model(self, scheduler_output):
        return None


def test_a_feature_is_off_as_a_whole_when_one_of_its_rows_does_not_fit():
    thread_rows = tuple(r for r in TABLE if r.feature is Feature.THREAD_HAND_OFF)
    assert [r.method for r in thread_rows] == ["take_draft_token_ids", "execute_model"]
    collect, prepare = (r.name for r in thread_rows)

    class Odd(Runner):
        def execute_model(self):  # another signature: "thread prepare" does not fit
            return None

    odd = type("OddRunner", (Odd,), {})
    report = apply_patches("all", version=TESTED, resolver=lambda t: odd, table=thread_rows)
    assert report.rows[collect] and report.rows[prepare]  # both off, with the reason
    assert "take_draft_token_ids" not in vars(odd) and not report.on(Feature.THREAD_HAND_OFF)
    good = type("GoodRunner", (Runner,), {})
    report = apply_patches("all", version=TESTED, resolver=lambda t: good, table=thread_rows)
    assert report.rows == {collect: "", prepare: ""} and report.on(Feature.THREAD_HAND_OFF)
    assert "take_draft_token_ids" in vars(good) and "execute_model" in vars(good)
    assert "features on: thread hand-off; off: none" in report.line()


def test_outside_the_tested_span_only_the_method_rewrite_applies(monkeypatch):
    class EngineArgs:
        def create_speculative_config(self, *args):
            return "built"

    runner = type("R", (Runner,), {})
    resolver = lambda t: EngineArgs if t == table.ENGINE_ARGS else runner  # noqa: E731
    report = apply_patches("all", version="0.40.0", resolver=resolver)
    any_vllm = {r.name for r in TABLE if r.feature in ANY_VLLM}
    assert report.rows["method='specdec': EngineArgs.create_speculative_config"] == ""
    assert (
        report.rows["--speculative-config check: EngineArgs.add_cli_args"] == "EngineArgs.add_cli_args: no add_cli_args"
    )
    assert all("outside the tested versions" in why for name, why in report.rows.items() if name not in any_vllm)
    assert "propose_draft_token_ids" not in vars(runner)  # plain custom_class: the runner is left alone
    assert report.on(Feature.METHOD) and not report.on(Feature.SCHEDULE)
    monkeypatch.setattr(table, "vllm_version", lambda: "0.40.0")
    assert "outside the tested versions" in table.schedule_hooks_problem()  # no whitelist without its hooks


def test_the_start_up_line_names_the_features_and_why_they_are_off():
    why = "CudagraphDispatcher.dispatch: CudagraphDispatcher.dispatch is not the one this patch was written for"
    rows = {"request ids: GPUModelRunner.propose_draft_token_ids": ""}
    rows |= {r.name: why for r in TABLE if r.feature is Feature.NARROW_GRAPHS}
    rows["ragged graphs: GPUModelRunner._build_attention_metadata"] = ""
    assert PatchReport("0.26.0", rows).line() == (
        "specdec: 2/6 vLLM patches applied (vLLM 0.26.0); features on: request ids; off: "
        f"narrow graphs ({why}), ragged graphs (needs narrow graphs)"
    )


def test_the_proposer_logs_the_whole_tables_line_once(monkeypatch):
    """Building the proposer (once per engine, in the model runner) applies the whole table and logs its one line;
    nothing else logs a line of the table."""
    from specdec.vllm_plugin import proposer as proposer_module

    report = PatchReport(TESTED, {r.name: "" for r in TABLE})
    stages, lines = [], []
    monkeypatch.setattr(proposer_module, "apply_patches", lambda stage: stages.append(stage) or report)
    monkeypatch.setattr(
        proposer_module, "logger", SimpleNamespace(info=lambda *a: lines.append(a[0] % a[1:]), warning=lambda *a: None)
    )
    cfg = SimpleNamespace(
        additional_config={"specdec": {"draft_timeout_ms": 0}},
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=64),
    )
    prop = proposer_module.SpecdecProposer(cfg)
    prop.close()
    table_lines = [line for line in lines if "vLLM patches applied" in line]
    assert stages == ["all"] and table_lines == [report.line()]
    assert report.line().startswith(
        f"specdec: {len(TABLE)}/{len(TABLE)} vLLM patches applied (vLLM {TESTED}); "
        "features on: method='specdec', schedule, "
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has vLLM)")
@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_every_row_fits_the_installed_vllm(row, monkeypatch):
    """On a real vLLM (each tested release): every row's targets import and its check passes (nothing applied), a
    row switched off by its constant included (switched on here)."""
    from specdec.vllm_plugin.patches import runner

    monkeypatch.setattr(runner, "NEAR_END_ON", True)
    assert row.problem(table.resolve(row.target)) == ""


def test_a_row_switched_off_by_its_constant_says_so_and_passes_through(monkeypatch):
    """Drafts near max_model_len: off (``NEAR_END_ON``) the row is not applied and the start-up line says why; on,
    its wrapper says every step fits our drafter and leaves vLLM's guard to any other drafter (and to a step
    without attention metadata)."""
    from specdec.vllm_plugin.patches import runner

    class Runner:
        def _input_fits_in_drafter(self, common_attn_metadata):
            return common_attn_metadata is not None and common_attn_metadata.max_seq_len + 16 <= 64

    rows = tuple(r for r in TABLE if r.feature is Feature.NEAR_END)
    monkeypatch.setattr(runner, "NEAR_END_ON", False)
    report = table.apply_patches("all", version=TESTED, resolver=lambda name: Runner, table=rows)
    assert "switched off (NEAR_END_ON)" in report.features()[Feature.NEAR_END]
    assert not is_wrapped(Runner._input_fits_in_drafter, Feature.NEAR_END.label)
    monkeypatch.setattr(runner, "NEAR_END_ON", True)
    assert table.apply_patches("all", version=TESTED, resolver=lambda name: Runner, table=rows).on(Feature.NEAR_END)
    near = SimpleNamespace(max_seq_len=60)
    theirs, ours = Runner(), Runner()
    ours.drafter = type("Ours", (), {PROPOSER_MARK: True})()
    assert ours._input_fits_in_drafter(near) and not theirs._input_fits_in_drafter(near)
    assert not ours._input_fits_in_drafter(None)


MODULES = sorted(m for m in PACKAGE_MODULES if m.startswith("specdec.vllm_plugin"))


def test_the_plugin_has_no_import_cycle():
    plugin = set(MODULES)
    graph = {m: (imports_of(PACKAGE_MODULES[m]) & plugin) - {m} for m in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_every_plugin_module_imports_alone():
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    for m in MODULES:
        subprocess.run([sys.executable, "-c", code, m], check=True, capture_output=True, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not importable (scripts/test.sh has vLLM)")
def test_the_plugin_load_alone_patches_the_scheduler():
    """Under TP > 1 the scheduler's engine-core process builds no proposer (the model runners live in worker
    processes): the plugin's load must patch the scheduler by itself, or every request keeps vLLM's k draft slots
    and the driver's slot notes are never read. A fresh process that only loads the plugin, as vLLM's engine core
    does, has the scheduler's rows applied."""
    code = (
        "from specdec.vllm_plugin.entry.register import register\n"
        "from specdec.vllm_plugin.patches.table import SCHEDULER, TABLE\n"
        "report = register()\n"
        "from vllm.v1.core.sched.async_scheduler import AsyncScheduler as S\n"
        "from specdec.vllm_plugin.patches.common import is_wrapped\n"
        "from specdec.vllm_plugin.patches.features import Feature as F\n"
        "print(all(report.rows[r.name] == '' for r in TABLE if r.target == SCHEDULER))\n"
        "print(is_wrapped(S._update_after_schedule, F.ADAPTIVE_SLOTS.label),"
        " is_wrapped(S.schedule, F.SLOT_REGRANT.label), is_wrapped(S.update_from_output, F.TP_SCHEDULE.label))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    assert out.stdout.splitlines()[-2:] == ["True", "True True True"], out.stdout[-2000:] + out.stderr[-2000:]
    scheduler_rows = [r.method for r in TABLE if r.target == table.SCHEDULER]
    assert scheduler_rows == ["schedule", "_update_after_schedule", "update_from_output"]
    assert all(r.stage == "register" for r in TABLE if r.target == table.SCHEDULER)
