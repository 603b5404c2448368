"""Every vLLM patch of the plugin, one row each, applied by one function (``apply_patches``).

A row names its vLLM target (module and attribute), how the target's version or shape is checked, the feature it
serves and what runs without it (its fallback). A feature is on only when every row serving it applied: no
async-scheduling whitelist without the runner hooks that feed it, no narrow slots without their CUDA graphs. On a
vLLM outside the tested span (``versions.in_tested_span``) every optional row is off and the plugin runs through
vLLM's plain ``custom_class`` path. The report (``PatchReport``) makes the one start-up line.

Rows are applied in two stages: ``"register"`` (every process, at plugin load: the speculative-config rewrite, the
whitelist, and the scheduler's rows, since the scheduler's engine-core process builds no proposer under TP > 1, where
the model runners live in worker processes) and ``"worker"`` (the process of the model runner, when the proposer is
built; a one-GPU engine core holds its runner too). Patching is
idempotent and its state lives on the patched vLLM classes (the wrappers' marks), so this module keeps none.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.vllm_plugin.entry.rewrite import patch_engine_args
from specdec.vllm_plugin.patches import async_sched, async_slots, compile_warmup, graphs, ragged_keys, runner, tp_notes
from specdec.vllm_plugin.patches.common import source_has
from specdec.vllm_plugin.versions import TESTED_VLLM_VERSIONS, in_tested_span

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
DISPATCHER = "vllm.v1.cudagraph_dispatcher:CudagraphDispatcher"
SCHEDULER = "vllm.v1.core.sched.async_scheduler:AsyncScheduler"
WORKER = "vllm.v1.worker.gpu_worker:Worker"
ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"
CONFIG_MODULE = "vllm.config.vllm"  # a module target (the whitelist global lives there)


@dataclass(frozen=True)
class Patch:
    """One row of the table."""

    name: str
    targets: tuple[str, ...]  # "module:Class" (or a module) the patch changes
    attribute: str  # what of them it wraps
    feature: str  # the feature it serves
    check: str  # how its version / shape is checked
    fallback: str  # what runs without it
    problem: Callable[..., str]  # targets -> '' if the patch fits them, else the reason
    apply: Callable[..., bool]  # targets -> True if applied (idempotent)
    stage: str = "worker"
    optional: bool = True  # False: applied on any vLLM (the method's rewrite into custom_class)


def _sources(cls: Any, wanted: dict[str, str]) -> str:
    for name, text in wanted.items():
        if not source_has(getattr(cls, name, None), text):
            return f"{cls.__name__}.{name} is not the one this patch was written for"
    return ""


def _engine_args_problem(cls: Any) -> str:
    return "" if callable(getattr(cls, "create_speculative_config", None)) else "no create_speculative_config"


def _whitelist(module: Any) -> bool:
    return async_sched.wrap_post_init(module, hooks_problem=schedule_hooks_problem, tp_problem=schedule_tp_problem)


def _graphs_problem(runner_cls: Any, dispatcher_cls: Any) -> str:
    return _sources(dispatcher_cls, graphs.DISPATCHER_SOURCE) or _sources(runner_cls, graphs.RUNNER_SOURCE)


def _ragged_problem(runner_cls: Any, dispatcher_cls: Any) -> str:
    return _graphs_problem(runner_cls, dispatcher_cls) or _sources(runner_cls, ragged_keys.RAGGED_SOURCE)


def _warmup_problem(worker_cls: Any) -> str:
    fn = getattr(worker_cls, "compile_or_warm_up_model", None)
    return "" if callable(fn) else "Worker.compile_or_warm_up_model is missing"


TABLE: tuple[Patch, ...] = (
    Patch(
        "speculative config",
        (ENGINE_ARGS,),
        "create_speculative_config, add_cli_args (--speculative-config checked as parsed)",
        "method='specdec'",
        "the method exists",
        "only the custom_class form works",
        _engine_args_problem,
        patch_engine_args,
        stage="register",
        optional=False,
    ),
    Patch(
        "async whitelist",
        (CONFIG_MODULE,),
        "VllmConfig.__post_init__",
        "schedule",
        f"source contains {async_sched.WHITELIST_SOURCE!r}",
        "vLLM schedules synchronously",
        async_sched.whitelist_problem,
        _whitelist,
        stage="register",
    ),
    Patch(
        "request ids",
        (RUNNER,),
        "propose_draft_token_ids",
        "request ids",
        "leading parameters (self, scheduler_output)",
        "request ids read from the caller's frame",
        runner.bind_problem,
        runner.patch_bind,
    ),
    Patch(
        "thread collect",
        (RUNNER,),
        "take_draft_token_ids",
        "thread hand-off",
        "parameters (self) and _get_draft_token_ids_cpu",
        "thread mode collects its drafts in propose",
        runner.take_problem,
        runner.patch_take,
    ),
    Patch(
        "thread prepare",
        (RUNNER,),
        "execute_model",
        "thread hand-off",
        "leading parameters (self, scheduler_output)",
        "thread mode collects its drafts in propose",
        runner.execute_problem,
        runner.patch_execute,
    ),
    Patch(
        "async runner hooks",
        (RUNNER,),
        "_bookkeeping_sync, propose_draft_token_ids, _prepare_input_ids, execute_model, _model_forward",
        "schedule",
        "leading parameters of each, _copy_valid_sampled_token_count exists",
        "vLLM schedules synchronously",
        async_sched.async_runner_problem,
        async_sched.patch_async_runner,
    ),
    Patch(
        "adaptive slots",
        (SCHEDULER,),
        "_update_after_schedule, schedule",
        "adaptive slots",
        f"source contains {async_slots.SCHEDULER_SOURCE!r}",
        "every request keeps vLLM's k draft slots",
        async_slots.scheduler_problem,
        async_slots.patch_async_scheduler,
        stage="register",  # the scheduler's process: under TP > 1 it builds no proposer
    ),
    Patch(
        "slot notes out",
        (RUNNER,),
        "sample_tokens",
        "tensor-parallel schedule",
        "leading parameters (self, grammar_output)",
        "TP > 1 drafts in thread mode",
        tp_notes.runner_problem,
        tp_notes.patch_runner,
    ),
    Patch(
        "slot notes in",
        (SCHEDULER,),
        "update_from_output",
        "tensor-parallel schedule",
        "leading parameters (self, scheduler_output, model_runner_output)",
        "TP > 1 drafts in thread mode",
        tp_notes.scheduler_problem,
        tp_notes.patch_scheduler,
        stage="register",  # the scheduler's process: under TP > 1 it builds no proposer
    ),
    Patch(
        "narrow graphs",
        (RUNNER, DISPATCHER),
        "CudagraphDispatcher.initialize_cudagraph_keys / dispatch, GPUModelRunner._determine_batch_execution_and_"
        "padding / _warmup_and_capture / _dummy_run",
        "narrow graphs",
        "source of each method",
        "no narrow steps (per-request slots)",
        _graphs_problem,
        graphs.patch_narrow_graphs,
    ),
    Patch(
        "ragged graphs",
        (RUNNER, DISPATCHER),
        "GPUModelRunner._build_attention_metadata / _check_and_update_cudagraph_mode",
        "ragged graphs",
        "source of each method",
        "ragged verify batches run vLLM's piecewise graphs",
        _ragged_problem,
        graphs.patch_narrow_graphs,
    ),
    Patch(
        "compile warm-up",
        (WORKER,),
        "compile_or_warm_up_model",
        "compile warm-up",
        "the method exists",
        "vLLM's batch-change correction compiles at first use",
        _warmup_problem,
        compile_warmup.patch_worker_warmup,
    ),
)


@dataclass
class PatchReport:
    """Per row: '' if applied, else why not; built by ``apply_patches`` for one process."""

    version: str
    rows: dict[str, str] = field(default_factory=dict)

    def features(self) -> dict[str, str]:
        """feature -> '' if every row serving it applied, else the first reason."""
        out: dict[str, str] = {}
        for row in TABLE:
            if row.name in self.rows and not out.get(row.feature):
                out[row.feature] = self.rows[row.name] and f"{row.name}: {self.rows[row.name]}"
        return out

    def on(self, feature: str) -> bool:
        return self.features().get(feature) == ""

    def line(self) -> str:
        """The start-up line, e.g. ``specdec: 9/10 vLLM patches applied; features on: ...; off: ... (reason)``."""
        applied = sum(not why for why in self.rows.values())
        feats = self.features()
        on = [f for f, why in feats.items() if not why]
        off = [f"{f} ({why})" for f, why in feats.items() if why]
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


def apply_row(row: Patch, *, in_span: bool, resolver: Callable[[str], Any] = resolve) -> str:
    """Apply one row: '' if applied, else why not (its fallback then runs)."""
    if row.optional and not in_span:
        return f"vLLM outside the tested versions {', '.join(TESTED_VLLM_VERSIONS)}"
    try:
        targets = [resolver(t) for t in row.targets]
    except Exception as exc:  # noqa: BLE001 - a missing vLLM module is a fallback, never a failed start
        return f"not importable ({type(exc).__name__})"
    try:
        why = row.problem(*targets)
        if not why and not row.apply(*targets):
            why = "not applied"
    except Exception as exc:  # noqa: BLE001 - an optimisation must never stop the engine
        why = f"failed ({exc!r})"
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


def _blocked_features(rows: list[Patch], *, in_span: bool, resolver: Callable[[str], Any]) -> dict[str, str]:
    """feature -> the reason one of its rows cannot apply (checked before any row of it is applied)."""
    blocked: dict[str, str] = {}
    for row in rows:
        if row.feature in blocked or (row.optional and not in_span):
            continue
        try:
            why = row.problem(*[resolver(t) for t in row.targets])
        except Exception as exc:  # noqa: BLE001
            why = f"not importable ({type(exc).__name__})"
        if why:
            blocked[row.feature] = f"{row.name}: {why}"
    return blocked


def schedule_hooks_problem() -> str:
    """'' if the runner hooks of schedule mode fit this vLLM (asked by the whitelist, for our configurations only,
    so that vLLM never schedules asynchronously for a proposer that cannot take part)."""
    if not in_tested_span(vllm_version()):
        return f"vLLM outside the tested versions {', '.join(TESTED_VLLM_VERSIONS)}"
    try:
        return async_sched.async_runner_problem(resolve(RUNNER))
    except Exception as exc:  # noqa: BLE001
        return f"the model runner is not importable ({type(exc).__name__})"


def schedule_tp_problem() -> str:
    """'' if the slot notes of schedule mode under TP > 1 fit this vLLM (asked by the whitelist for TP > 1)."""
    try:
        return tp_notes.runner_problem(resolve(RUNNER)) or tp_notes.scheduler_problem(resolve(SCHEDULER))
    except Exception as exc:  # noqa: BLE001
        return f"the model runner or scheduler is not importable ({type(exc).__name__})"
