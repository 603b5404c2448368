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
from specdec.vllm_plugin.patches import table
from specdec.vllm_plugin.patches.table import TABLE, PatchReport, apply_patches, apply_row

TESTED = "0.26.0"


class Empty:
    """A vLLM class of another shape: none of the methods the patches wrap."""


def empty_resolver(target: str):
    return SimpleNamespace() if ":" not in target else type("Empty", (Empty,), {})


@pytest.mark.parametrize("row", TABLE, ids=[r.name for r in TABLE])
def test_every_row_falls_back_on_a_vllm_of_another_shape(row):
    """Each row's check refuses a target without the methods it wraps, and nothing is patched (its fallback runs)."""
    targets = [empty_resolver(t) for t in row.targets]
    before = [dict(vars(t)) for t in targets]
    resolved = iter(targets)
    why = apply_row(row, in_span=True, resolver=lambda t: next(resolved))
    assert why and [dict(vars(t)) for t in targets] == before
    assert row.fallback and row.check and row.feature and row.attribute


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
    thread_rows = tuple(r for r in TABLE if r.feature == "thread hand-off")
    assert {r.name for r in thread_rows} == {"thread collect", "thread prepare"}

    class Odd(Runner):
        def execute_model(self):  # another signature: "thread prepare" does not fit
            return None

    odd = type("OddRunner", (Odd,), {})
    report = apply_patches("all", version=TESTED, resolver=lambda t: odd, table=thread_rows)
    assert report.rows["thread collect"] and report.rows["thread prepare"]  # both off, with the reason
    assert "take_draft_token_ids" not in vars(odd) and not report.on("thread hand-off")
    good = type("GoodRunner", (Runner,), {})
    report = apply_patches("all", version=TESTED, resolver=lambda t: good, table=thread_rows)
    assert report.rows == {"thread collect": "", "thread prepare": ""} and report.on("thread hand-off")
    assert "take_draft_token_ids" in vars(good) and "execute_model" in vars(good)
    assert "features on: thread hand-off; off: none" in report.line()


def test_outside_the_tested_span_only_the_method_rewrite_applies(monkeypatch):
    class EngineArgs:
        def create_speculative_config(self, *args):
            return "built"

    runner = type("R", (Runner,), {})
    resolver = lambda t: EngineArgs if t == table.ENGINE_ARGS else runner  # noqa: E731
    report = apply_patches("all", version="0.40.0", resolver=resolver)
    assert report.rows["speculative config"] == ""
    assert all(
        "outside the tested versions" in why for name, why in report.rows.items() if name != "speculative config"
    )
    assert "propose_draft_token_ids" not in vars(runner)  # plain custom_class: the runner is left alone
    assert report.on("method='specdec'") and not report.on("schedule")
    monkeypatch.setattr(table, "vllm_version", lambda: "0.40.0")
    assert "outside the tested versions" in table.schedule_hooks_problem()  # no whitelist without its hooks


def test_the_start_up_line_names_the_features_and_why_they_are_off():
    report = PatchReport("0.26.0", {"request ids": "", "narrow graphs": "CudagraphDispatcher.dispatch is not the one"})
    assert report.line() == (
        "specdec: 1/2 vLLM patches applied (vLLM 0.26.0); features on: request ids; off: "
        "narrow graphs (narrow graphs: CudagraphDispatcher.dispatch is not the one)"
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
def test_every_row_fits_the_installed_vllm(row):
    """On a real vLLM (each tested release): every row's targets import and its check passes (nothing applied)."""
    targets = [table.resolve(t) for t in row.targets]
    assert row.problem(*targets) == ""


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
        "report = register()\n"
        "from vllm.v1.core.sched.async_scheduler import AsyncScheduler as S\n"
        "from specdec.vllm_plugin.patches.common import is_wrapped\n"
        "print(report.rows['adaptive slots'] == '' and report.rows['slot notes in'] == '')\n"
        "print(is_wrapped(S._update_after_schedule, 'slots'), is_wrapped(S.schedule, 'slots'),"
        " is_wrapped(S.update_from_output, 'tp_notes'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=300)
    assert out.stdout.splitlines()[-2:] == ["True", "True True True"], out.stdout[-2000:] + out.stderr[-2000:]
    scheduler_rows = [r.name for r in TABLE if table.SCHEDULER in r.targets]
    assert scheduler_rows == ["adaptive slots", "slot notes in"]
    assert all(r.stage == "register" for r in TABLE if table.SCHEDULER in r.targets)
