"""Every vLLM method the plugin wraps, one row each, applied by one function (``apply_patches``).

A row names its vLLM target (module and class), the method it wraps, the feature it serves (``features.Feature``:
its name in the start-up line and its fallback), the maker of the wrapper and the check of the target's version or
shape (``problem``). Every row is applied by the one apply-and-mark, ``common.wrap_method``. A feature is on only
when every row serving it applied and the feature it needs (``features.NEEDS``) is on: no async-scheduling
whitelist without the runner hooks that feed it, no ragged graphs without the narrow graphs' dispatcher. On a vLLM
outside the tested span (``versions.in_tested_span``) every row but those of ``features.ANY_VLLM`` is off and the
plugin runs through vLLM's plain ``custom_class`` path. The report (``PatchReport``) makes the one start-up line.

Rows are applied in two stages: ``"register"`` (every process, at plugin load: the speculative-config rewrite, the
whitelist, and the scheduler's rows, since the scheduler's engine-core process builds no proposer under TP > 1, where
the model runners live in worker processes) and ``"worker"`` (the process of the model runner, when the proposer is
built; a one-GPU engine core holds its runner too). Rows wrapping one method nest in table order (the later row's
wrapper outside). Patching is idempotent and its state lives on the patched vLLM classes (the wrappers' marks), so
this module keeps none.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.vllm_plugin.entry import rewrite
from specdec.vllm_plugin.patches import async_sched as sched
from specdec.vllm_plugin.patches import async_slots as slots
from specdec.vllm_plugin.patches import compile_warmup as warmup
from specdec.vllm_plugin.patches import graphs, ragged_keys, runner, tp_notes
from specdec.vllm_plugin.patches.common import wrap_method
from specdec.vllm_plugin.patches.features import ANY_VLLM, NEEDS, Feature
from specdec.vllm_plugin.versions import TESTED_VLLM_VERSIONS, in_tested_span

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
DISPATCHER = "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher"
SCHEDULER = "vllm.v1.core.sched.async_scheduler:AsyncScheduler"
WORKER = "vllm.v1.worker.gpu_worker:Worker"
ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"
CONFIG_MODULE = "vllm.config.vllm"  # a module target (the whitelist global lives there)
REGISTER, WORKER_STAGE = "register", "worker"  # the stages (module docstring)
F = Feature


@dataclass(frozen=True)
class Patch:
    """One row of the table: one vLLM method wrapped for one feature."""

    target: str  # "module:Class" (or a module) the row changes
    method: str  # the method of the target it wraps ("Class.method" under a module target)
    feature: Feature  # the feature it serves
    make: Callable[[Any, Any], Callable[..., Any]]  # (original method, resolved target) -> the wrapper
    problem: Callable[[Any], str]  # resolved target -> '' if the row fits it, else the reason (its check)
    stage: str = WORKER_STAGE
    static: bool = False  # the method is a staticmethod

    @property
    def where(self) -> str:
        """``Class.method`` (``Class.method`` under a module target too)."""
        owner = self.target.partition(":")[2]
        return f"{owner}.{self.method}" if owner else self.method

    @property
    def name(self) -> str:
        """The row's key in ``PatchReport.rows``: feature and method (one method may serve two features)."""
        return f"{self.feature.label}: {self.where}"

    @property
    def check(self) -> str:
        """How the target's version or shape is checked (the first line of the check's docstring)."""
        doc = (self.problem.__doc__ or "").strip()
        return doc.splitlines()[0].removeprefix("'' if ") if doc else ""


def _whitelist(orig: Any, module: Any) -> Any:
    return sched.wrap_post_init(orig, module, hooks_problem=schedule_hooks_problem, tp_problem=schedule_tp_problem)


NARROW, RAGGED, ADAPTIVE, TP = F.NARROW_GRAPHS, F.RAGGED_GRAPHS, F.ADAPTIVE_SLOTS, F.TP_SCHEDULE
TABLE: tuple[Patch, ...] = (  # in application order
    Patch(ENGINE_ARGS, "create_speculative_config", F.METHOD, rewrite.wrap_create, rewrite.create_problem, REGISTER),
    Patch(CONFIG_MODULE, "VllmConfig.__post_init__", F.SCHEDULE, _whitelist, sched.whitelist_problem, REGISTER),
    Patch(RUNNER, "propose_draft_token_ids", F.REQUEST_IDS, runner.wrap_bind, runner.bind_problem),
    Patch(RUNNER, "take_draft_token_ids", F.THREAD_HAND_OFF, runner.wrap_take, runner.take_problem),
    Patch(RUNNER, "execute_model", F.THREAD_HAND_OFF, runner.wrap_execute, runner.execute_problem),
    Patch(RUNNER, "_input_fits_in_drafter", F.NEAR_END, runner.wrap_fits, runner.fits_problem),
    Patch(RUNNER, "_bookkeeping_sync", F.SCHEDULE, sched.wrap_bookkeeping, sched.async_runner_problem),
    Patch(RUNNER, "propose_draft_token_ids", F.SCHEDULE, sched.wrap_propose, sched.async_runner_problem),
    Patch(RUNNER, "_prepare_input_ids", F.SCHEDULE, sched.wrap_prepare, sched.async_runner_problem),
    Patch(RUNNER, "execute_model", F.SCHEDULE, sched.wrap_execute, sched.async_runner_problem),
    Patch(RUNNER, "_model_forward", F.SCHEDULE, sched.wrap_forward, sched.async_runner_problem),
    Patch(SCHEDULER, "schedule", F.SLOT_REGRANT, slots.wrap_schedule, slots.schedule_problem, REGISTER),
    Patch(SCHEDULER, "_update_after_schedule", ADAPTIVE, slots.wrap_update, slots.scheduler_problem, REGISTER),
    Patch(RUNNER, "sample_tokens", TP, tp_notes.wrap_sample_tokens, tp_notes.runner_problem),
    Patch(SCHEDULER, "update_from_output", TP, tp_notes.wrap_update_from_output, tp_notes.scheduler_problem, REGISTER),
    Patch(DISPATCHER, "initialize_cudagraph_keys", NARROW, graphs.wrap_initialize_keys, graphs.dispatcher_problem),
    Patch(DISPATCHER, "dispatch", NARROW, graphs.wrap_dispatch, graphs.dispatcher_problem),
    Patch(RUNNER, "_determine_batch_execution_and_padding", NARROW, graphs.wrap_determine, graphs.runner_problem),
    Patch(RUNNER, "_warmup_and_capture", NARROW, graphs.wrap_warmup_and_capture, graphs.runner_problem),
    Patch(RUNNER, "capture_model", F.GRAPH_LOG, graphs.wrap_capture_model, graphs.capture_problem),
    Patch(RUNNER, "_build_attention_metadata", RAGGED, ragged_keys.wrap_build_metadata, ragged_keys.ragged_problem),
    Patch(RUNNER, "_check_and_update_cudagraph_mode", RAGGED, ragged_keys.wrap_check_mode, ragged_keys.ragged_problem),
    Patch(WORKER, "compile_or_warm_up_model", F.COMPILE_WARMUP, warmup.wrap_warmup, warmup.worker_problem),
    Patch(ENGINE_ARGS, "add_cli_args", F.CLI_CHECK, rewrite.wrap_cli_args, rewrite.cli_args_problem, REGISTER, True),
)


@dataclass
class PatchReport:
    """Per row (``Patch.name``): '' if applied, else why not; built by ``apply_patches`` for one process."""

    version: str
    rows: dict[str, str] = field(default_factory=dict)

    def features(self) -> dict[Feature, str]:
        """feature -> '' if every row serving it applied (and the feature it needs is on), else the first reason."""
        out: dict[Feature, str] = {}
        for row in TABLE:
            if row.name in self.rows and not out.get(row.feature):
                out[row.feature] = self.rows[row.name]
        for feature, needed in NEEDS.items():
            if out.get(feature) == "" and out.get(needed):
                out[feature] = f"needs {needed.label}"
        return out

    def on(self, feature: Feature) -> bool:
        return self.features().get(feature) == ""

    def line(self) -> str:
        """The start-up line, e.g. ``specdec: 22/23 vLLM patches applied; features on: ...; off: ... (reason)``."""
        applied = sum(not why for why in self.rows.values())
        feats = self.features()
        on = [f.label for f, why in feats.items() if not why]
        off = [f"{f.label} ({why})" for f, why in feats.items() if why]
        return (
            f"specdec: {applied}/{len(self.rows)} vLLM patches applied (vLLM {self.version}); features on: "
            f"{', '.join(on) or 'none'}; off: {', '.join(off) or 'none'}"
        )


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - a broken vLLM install is reported as unknown
        return "unknown"


def resolve(target: str) -> Any:
    """The object ``target`` ("module:Class" or "module") names; raises if it cannot be imported."""
    module, _, name = target.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, name) if name else mod


def _outside_span(row: Patch, in_span: bool) -> str:
    if row.feature in ANY_VLLM or in_span:
        return ""
    return f"vLLM outside the tested versions {', '.join(TESTED_VLLM_VERSIONS)}"


def _problem(row: Patch, resolver: Callable[[str], Any]) -> tuple[Any, str]:
    """(the row's resolved target, '' if the row fits it, else the reason naming the method)."""
    try:
        target = resolver(row.target)
    except Exception as exc:  # noqa: BLE001 - a missing vLLM module is a fallback, never a failed start
        return None, f"{row.target} not importable ({type(exc).__name__})"
    why = row.problem(target)
    return target, why and f"{row.where}: {why}"


def wrap_row(row: Patch, target: Any) -> bool:
    """Wrap the row's method of ``target`` (resolved) by the one apply-and-mark, marked with the feature's name."""
    *path, attr = row.method.split(".")
    owner = functools.reduce(getattr, path, target)
    return wrap_method(owner, attr, row.feature.label, lambda orig: row.make(orig, target), static=row.static)


def apply_row(row: Patch, *, in_span: bool, resolver: Callable[[str], Any] = resolve) -> str:
    """Apply one row: '' if applied, else why not (its fallback then runs)."""
    why = _outside_span(row, in_span)
    if why:
        return why
    try:
        target, why = _problem(row, resolver)
        if not why and not wrap_row(row, target):
            why = f"{row.where}: not applied"
    except Exception as exc:  # noqa: BLE001 - an optimisation must never stop the engine
        why = f"{row.where}: failed ({exc!r})"
    return why


def apply_patches(
    stage: str,
    *,
    version: str | None = None,
    resolver: Callable[[str], Any] = resolve,
    table: tuple[Patch, ...] = TABLE,
) -> PatchReport:
    """Apply the rows of ``stage`` ("register" or "worker"; "all": both). A feature whose rows do not all fit is
    not applied at all (each row of it reports why). Returns the report of every row of the stage."""
    version = vllm_version() if version is None else version
    in_span = in_tested_span(version)
    rows = [r for r in table if stage in ("all", r.stage)]
    report = PatchReport(version)
    blocked = _blocked_features(rows, in_span=in_span, resolver=resolver)
    for row in rows:
        report.rows[row.name] = blocked.get(row.feature) or apply_row(row, in_span=in_span, resolver=resolver)
    return report


def _blocked_features(rows: list[Patch], *, in_span: bool, resolver: Callable[[str], Any]) -> dict[Feature, str]:
    """feature -> the reason one of its rows (or the feature it needs) cannot apply, checked before any row of it is
    applied."""
    blocked: dict[Feature, str] = {}
    for row in rows:
        if row.feature in blocked or _outside_span(row, in_span):
            continue
        try:
            why = _problem(row, resolver)[1]
        except Exception as exc:  # noqa: BLE001
            why = f"{row.where}: failed ({exc!r})"
        if why:
            blocked[row.feature] = why
    present = {row.feature for row in rows}
    for feature, needed in NEEDS.items():
        if feature in present and feature not in blocked and needed in blocked:
            blocked[feature] = f"needs {needed.label}"
    return blocked


def schedule_hooks_problem() -> str:
    """'' if the runner hooks of schedule mode fit this vLLM (asked by the whitelist, for our configurations only,
    so that vLLM never schedules asynchronously for a proposer that cannot take part)."""
    if not in_tested_span(vllm_version()):
        return f"vLLM outside the tested versions {', '.join(TESTED_VLLM_VERSIONS)}"
    try:
        return sched.async_runner_problem(resolve(RUNNER))
    except Exception as exc:  # noqa: BLE001
        return f"the model runner is not importable ({type(exc).__name__})"


def schedule_tp_problem() -> str:
    """'' if the slot notes of schedule mode under TP > 1 fit this vLLM (asked by the whitelist for TP > 1)."""
    try:
        return tp_notes.runner_problem(resolve(RUNNER)) or tp_notes.scheduler_problem(resolve(SCHEDULER))
    except Exception as exc:  # noqa: BLE001
        return f"the model runner or scheduler is not importable ({type(exc).__name__})"
