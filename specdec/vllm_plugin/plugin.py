"""The ``vllm.general_plugins`` entry point: ``{"method": "specdec", ...}`` for vLLM, and the runner hook.

vLLM loads general plugins in every process (front-end, engine core, workers), so ``register()`` is idempotent
and initialises no CUDA: it only wraps ``EngineArgs.create_speculative_config``, which rewrites

    {"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 16, "draft_timeout_ms": 20}
into
    speculative_config = {"method": "custom_class", "model": "specdec.vllm_plugin.proposer.SpecdecProposer",
                          "num_speculative_tokens": 16}
    additional_config["specdec"] = {"drafter": "suffix", "draft_timeout_ms": 20.0, ...}   # validated options

before vLLM validates it (its ``method`` is a closed Literal and unknown keys are forbidden). Everything after
that runs vLLM's supported custom_class path. ``ensure_runner_patch()`` (called by the proposer, i.e. inside
the worker process, once the runner module is loaded) wraps ``GPUModelRunner.propose_draft_token_ids`` so the
proposer sees the input batch (request ids by row) of each step.
"""
from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

from specdec.config import ConfigError
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.options import ADDITIONAL_CONFIG_KEY, METHOD, normalise_keys, split_speculative_config

logger = logging.getLogger(LOGGER_NAME)

TESTED_VLLM = ("0.26.", "0.32.")  # versions whose hooks were checked (others: patched if the shapes match)
_WRAPPED = "_specdec_wrapped"
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default when the user sets none (the value is filled in after our hook)
AUTO_CUDAGRAPH_MAX_TOKENS = 2048  # cap of the automatic capture-size raise (capture time and memory)
VLLM_DEFAULT_CAPTURE_TOKENS = 512  # vLLM's own cap on the default capture size
UNSAFE_CUDAGRAPH_MODE = "FULL"  # vLLM CUDAGraphMode that replays mixed verify batches from full graphs (run 18)
SAFE_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"  # vLLM's default: full graphs for uniform batches only
_state = {"registered": False, "runner_patched": False, "take_patched": False, "execute_patched": False,
          "async_patched": False, "scheduler_patched": False, "graphs_patched": False, "warmup_patched": False}


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:  # noqa: BLE001
        return "unknown"


def _check_version(what: str) -> None:
    version = _vllm_version()
    if not version.startswith(TESTED_VLLM):
        logger.warning("specdec: vLLM %s is not a tested version (%s); patching %s because its signature "
                       "matches", version, ", ".join(v + "x" for v in TESTED_VLLM), what)


def rewrite_engine_args(engine_args: Any) -> bool:
    """Rewrite ``engine_args.speculative_config`` in place if it asks for ``method="specdec"``.

    Returns True when rewritten. Raises ``ConfigError`` (a ValueError) naming a bad option and the valid ones.
    """
    spec = getattr(engine_args, "speculative_config", None)
    if getattr(engine_args, "spec_method", None) == METHOD:  # vLLM 0.32's --spec-method/--spec-tokens aliases
        spec = dict(spec or {}, method=METHOD)
        engine_args.spec_method = None
        if getattr(engine_args, "spec_tokens", None) is not None:
            spec["num_speculative_tokens"] = engine_args.spec_tokens
            engine_args.spec_tokens = None
    if not isinstance(spec, dict) or normalise_keys(spec).get("method") != METHOD:
        return False
    theirs, options = split_speculative_config(spec)
    extra = getattr(engine_args, "additional_config", None)
    extra = dict(extra) if isinstance(extra, dict) else {}
    given = extra.get(ADDITIONAL_CONFIG_KEY)
    if given is not None and given != options.to_dict():
        raise ConfigError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is set and the speculative config has "
                          f"method={METHOD!r}: give the options in one place only")
    extra[ADDITIONAL_CONFIG_KEY] = options.to_dict()
    engine_args.speculative_config = theirs
    engine_args.additional_config = extra
    raise_cudagraph_capture(engine_args, options.cudagraph_max_tokens, options.num_speculative_tokens)
    guard_full_cudagraphs(engine_args)
    return True


def guard_full_cudagraphs(engine_args: Any) -> bool:
    """Replace a user's ``cudagraph_mode=FULL`` by FULL_AND_PIECEWISE (warned). Returns True if replaced.

    FULL also replays mixed batches (requests verifying different draft lengths) from full CUDA graphs. On vLLM
    0.26 with FlashAttention 3 that breaks speculative verification: greedy outputs differed from no-spec on 8/8
    prompts at batch 1 and 64/64 at batch 64, and acceptance collapsed, for vLLM's own ``ngram`` as for ours
    (H200, ``eval/results/2026-11-22_h200_vllm_bench_run18_full_cudagraphs.md``). Lossless output comes first.
    """
    cc = getattr(engine_args, "compilation_config", None)
    mode = cc.get("cudagraph_mode") if isinstance(cc, dict) else getattr(cc, "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", str(mode)).upper() != UNSAFE_CUDAGRAPH_MODE:
        return False
    if isinstance(cc, dict):
        cc["cudagraph_mode"] = SAFE_CUDAGRAPH_MODE
    else:
        try:
            from vllm.config import CUDAGraphMode  # only reached inside vLLM's engine-args path
            cc.cudagraph_mode = CUDAGraphMode[SAFE_CUDAGRAPH_MODE]
        except (ImportError, KeyError) as exc:
            logger.warning("specdec: cudagraph_mode=FULL may change outputs and could not be replaced (%s)", exc)
            return False
    logger.warning("specdec: cudagraph_mode=FULL changes speculative outputs on vLLM 0.26 (mixed verify batches "
                   "in full CUDA graphs; measured for vLLM's ngram too): using %s instead", SAFE_CUDAGRAPH_MODE)
    return True


def raise_cudagraph_capture(engine_args: Any, setting: int, k: int) -> int | None:
    """Let verify batches (up to max_num_seqs x (k+1) tokens) run in CUDA graphs.

    vLLM captures graphs up to ``min(max_num_seqs x (k+1) x 2, 512)`` tokens by default, so a batch of 64
    requests with k=16 drafts (1,088 tokens) runs eagerly. ``setting`` -1 raises the limit to max_num_seqs x
    (k+1), at most ``AUTO_CUDAGRAPH_MAX_TOKENS``; N sets N; 0 leaves vLLM's default. A limit the user set
    (``max_cudagraph_capture_size`` or capture sizes, on the engine args or in ``compilation_config``) and
    ``enforce_eager`` always win. Returns the limit set, or None.
    """
    if setting == 0 or getattr(engine_args, "enforce_eager", False):
        return None
    cc = getattr(engine_args, "compilation_config", None)
    given = [getattr(engine_args, "max_cudagraph_capture_size", None),
             getattr(engine_args, "cudagraph_capture_sizes", None)]
    given += [cc.get(key) if isinstance(cc, dict) else getattr(cc, key, None)
              for key in ("max_cudagraph_capture_size", "cudagraph_capture_sizes")]
    if any(v is not None for v in given) or not hasattr(engine_args, "max_cudagraph_capture_size"):
        return None
    if setting < 0:
        seqs = getattr(engine_args, "max_num_seqs", None) or DEFAULT_MAX_NUM_SEQS
        setting = min(int(seqs) * (k + 1), AUTO_CUDAGRAPH_MAX_TOKENS)
    if setting <= VLLM_DEFAULT_CAPTURE_TOKENS:
        return None
    engine_args.max_cudagraph_capture_size = setting
    return setting


def patch_engine_args(engine_args_cls: Any) -> bool:
    """Wrap ``engine_args_cls.create_speculative_config`` (idempotent). Returns True if it is wrapped now."""
    orig = getattr(engine_args_cls, "create_speculative_config", None)
    if orig is None:
        logger.warning("specdec: %s has no create_speculative_config; method=%r unavailable (use the "
                       "custom_class form)", engine_args_cls.__name__, METHOD)
        return False
    if getattr(orig, _WRAPPED, False):
        return True

    @functools.wraps(orig)
    def create_speculative_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        rewrite_engine_args(self)
        return orig(self, *args, **kwargs)

    setattr(create_speculative_config, _WRAPPED, True)
    engine_args_cls.create_speculative_config = create_speculative_config
    return True


def register() -> None:
    """vLLM general-plugin entry point: idempotent, no CUDA initialisation."""
    if _state["registered"]:
        return
    _state["registered"] = True
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception as exc:  # noqa: BLE001 - never break vLLM start-up from a plugin
        logger.warning("specdec: vLLM's EngineArgs not importable (%r); method=%r unavailable", exc, METHOD)
        return
    _check_version("EngineArgs.create_speculative_config")
    patch_engine_args(EngineArgs)  # AsyncEngineArgs subclasses EngineArgs and inherits the wrapper
    from specdec.vllm_plugin.async_patch import patch_vllm_config

    patch_vllm_config()  # lifts the async-scheduling whitelist for async_mode="schedule" only


def patch_runner_class(runner_cls: Any) -> bool:
    """Wrap ``runner_cls.propose_draft_token_ids`` to hand SpecdecProposer the step's input batch."""
    orig = getattr(runner_cls, "propose_draft_token_ids", None)
    if orig is None:
        return False
    if getattr(orig, _WRAPPED, False):
        return True
    params = list(inspect.signature(orig).parameters)
    if params[:2] != ["self", "scheduler_output"]:
        logger.warning("specdec: %s.propose_draft_token_ids%s has an unexpected signature; not patched",
                       runner_cls.__name__, params)
        return False
    from specdec.vllm_plugin.proposer import SpecdecProposer

    @functools.wraps(orig)
    def propose_draft_token_ids(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SpecdecProposer):
            drafter.bind_step(self.input_batch, scheduler_output)
        return orig(self, scheduler_output, *args, **kwargs)

    setattr(propose_draft_token_ids, _WRAPPED, True)
    runner_cls.propose_draft_token_ids = propose_draft_token_ids
    _state["take_patched"] = patch_take_draft_token_ids(runner_cls)
    _state["execute_patched"] = patch_execute_model(runner_cls)
    return True


def patch_execute_model(runner_cls: Any) -> bool:
    """Wrap ``runner_cls.execute_model`` so the thread mode's proposer sees each step's scheduler output as vLLM
    starts executing it (finished requests stop, new ones start while the GPU runs: ``prepare_step``)."""
    orig = getattr(runner_cls, "execute_model", None)
    if orig is None:
        return False
    if getattr(orig, _WRAPPED, False):
        return True
    if list(inspect.signature(orig).parameters)[:2] != ["self", "scheduler_output"]:
        logger.warning("specdec: %s.execute_model has an unexpected signature; thread mode starts and stops "
                       "requests when it drafts", runner_cls.__name__)
        return False
    from specdec.vllm_plugin.proposer import SpecdecProposer

    @functools.wraps(orig)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SpecdecProposer):
            drafter.prepare_step(scheduler_output)
        return orig(self, scheduler_output, *args, **kwargs)

    setattr(execute_model, _WRAPPED, True)
    runner_cls.execute_model = execute_model
    return True


def patch_take_draft_token_ids(runner_cls: Any) -> bool:
    """Wrap ``runner_cls.take_draft_token_ids`` so overlapped drafts (async overlap mode) are collected there.

    vLLM's synchronous loop calls it after ``scheduler.update_from_output``: drafting overlaps that work.
    Requires the runner to keep custom_class drafts as a list in ``_draft_token_ids`` (vLLM 0.26 and 0.32).
    """
    orig = getattr(runner_cls, "take_draft_token_ids", None)
    if orig is None or not hasattr(runner_cls, "_get_draft_token_ids_cpu"):
        return False
    if getattr(orig, _WRAPPED, False):
        return True
    if list(inspect.signature(orig).parameters) != ["self"]:
        logger.warning("specdec: %s.take_draft_token_ids has an unexpected signature; overlapped drafting "
                       "collects in propose (no overlap)", runner_cls.__name__)
        return False
    from specdec.vllm_plugin.proposer import SpecdecProposer

    @functools.wraps(orig)
    def take_draft_token_ids(self: Any) -> Any:
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, SpecdecProposer):
            drafts = drafter.collect_deferred()
            if drafts is not None and isinstance(getattr(self, "_draft_token_ids", None), list):
                self._draft_token_ids = drafts
        return orig(self)

    setattr(take_draft_token_ids, _WRAPPED, True)
    runner_cls.take_draft_token_ids = take_draft_token_ids
    return True


def take_hook_installed() -> bool:
    return bool(_state["take_patched"])


def ensure_runner_patch() -> bool:
    """Patch vLLM's V1 GPU model runner (called from the proposer, inside the worker). Idempotent."""
    if _state["runner_patched"]:
        return True
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    except Exception as exc:  # noqa: BLE001 - CPU-only tests, other platforms
        logger.debug("specdec: GPUModelRunner not importable (%r); request ids come from the caller frame", exc)
        return False
    _check_version("GPUModelRunner.propose_draft_token_ids")
    _state["runner_patched"] = patch_runner_class(GPUModelRunner)
    if _state["runner_patched"]:
        from specdec.vllm_plugin.async_patch import patch_async_runner, patch_async_scheduler

        _state["async_patched"] = patch_async_runner(GPUModelRunner)
        try:  # the scheduler lives in this process with the one-GPU executor (the only one schedule mode runs on)
            from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        except Exception as exc:  # noqa: BLE001
            logger.debug("specdec: AsyncScheduler not importable (%r); uniform draft slots", exc)
        else:
            _state["scheduler_patched"] = patch_async_scheduler(AsyncScheduler)
        _state["graphs_patched"] = _patch_graphs(GPUModelRunner)
        _state["warmup_patched"] = _patch_worker_warmup()
    return _state["runner_patched"]


def _patch_worker_warmup() -> bool:
    """Compile vLLM's async spec-decode correction ahead (``compile_warmup.py``; pass-through for other engines)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker

        from specdec.vllm_plugin.compile_warmup import patch_worker_warmup

        return patch_worker_warmup(Worker)
    except Exception as exc:  # noqa: BLE001 - an optimisation must never stop the engine
        logger.warning("specdec: no compile warm-up for async spec decoding (%r)", exc)
        return False


def _patch_graphs(runner_cls: Any) -> bool:
    """FULL CUDA graphs for narrow verify batches (``graphs.py``; pass-through for other engines)."""
    try:
        from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

        from specdec.vllm_plugin.graphs import patch_narrow_graphs

        return patch_narrow_graphs(runner_cls, CudagraphDispatcher)
    except Exception as exc:  # noqa: BLE001 - an optimisation must never stop the engine
        logger.warning("specdec: narrow_slots run without full CUDA graphs (%r)", exc)
        return False
