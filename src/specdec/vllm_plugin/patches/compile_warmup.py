"""Compile vLLM's async speculative-decoding correction ahead, for every batch-size class (schedule mode).

Under async scheduling with speculative decoding, vLLM 0.26-0.32's runner corrects each step's computed-token counts
on the GPU (``_prepare_inputs``) with ``update_num_computed_tokens_for_batch_change``, a
``torch.compile(dynamic=True)`` function. Its inputs are sized by the step's requests (n), the previous step's
(m: the valid-token counts our capture hands vLLM, ``feed.valid_counts``) and ``max_num_reqs`` (R). Dynamo
specialises sizes of 1 and, by duck sizing, sizes that were equal when it traced, so a natural run recompiles it
several times: at the first step whose n differs from m, the first after a step of one request (m = 1), the first
of one request after a larger one, and so on (CPU check with vLLM's own function and a counting backend:
``tests/test_vllm_compile_warmup.py``). On the GPU each recompile holds the host about half a second with the GPU
idle, once per engine and class, in the middle of serving (vLLM's own drafters do not take that path).

``warm_batch_change`` calls the function right after vLLM's own warm-up (``Worker.compile_or_warm_up_model``) for
the four classes ``WARM_SHAPES`` (the general one first: n != m, both >= 2; then n = 1, m = 1, both 1), on scratch
tensors made as the runner's call makes them: its dtypes, views of n rows of R-sized buffers where it slices, under
``execute_model``'s inference mode. Dynamo guards all three (``TORCH_LOGS=recompiles`` names them: "GLOBAL_STATE
changed: grad_mode", a view's base size), so scratch tensors made otherwise (fresh [n] tensors, grad mode on) would
miss every later call and the engine would recompile mid-run as without the warm-up. Every later (n, m) matches one
of the four graphs. A failure is logged once and leaves the engine as it was (the stalls
come back, nothing else changes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.modes.feed import VALID_COUNT_DTYPE
from specdec.vllm_plugin.patches import async_sched as async_patch

logger = logging.getLogger(LOGGER_NAME)

FUNCTION_NAME = "update_num_computed_tokens_for_batch_change"  # vLLM 0.26-0.32, imported into gpu_model_runner
# (this step's requests, the previous step's): the general class (distinct sizes >= 2) first, then the 1-classes
WARM_SHAPES = ((3, 2), (1, 2), (3, 1), (1, 1))


def batch_change_function() -> Callable[..., Any] | None:
    """vLLM's correction as its runner calls it (a module global of ``gpu_model_runner``), or None."""
    try:
        from vllm.v1.worker import gpu_model_runner
    except Exception:  # noqa: BLE001 - CPU-only installs, other platforms
        return None
    return getattr(gpu_model_runner, FUNCTION_NAME, None)


def warm_batch_change(runner: Any, fn: Callable[..., Any] | None = None) -> int:
    """Call ``fn`` (default: ``batch_change_function()``) once per ``WARM_SHAPES`` class on scratch tensors shaped
    and typed as ``runner``'s call makes them; returns the calls made (0 where the runner takes no such path)."""
    import torch

    fn = fn if fn is not None else batch_change_function()
    if fn is None or not getattr(runner, "use_async_spec_decode", False):
        return 0
    # scratch twins of the runner's [R] buffers: the runner passes the first whole and slices the next two to views
    # of n rows (Dynamo guards a view's base size), the last whole
    computed, accepted, positions, drafts = (
        _twin(b)
        for b in (
            runner.num_computed_tokens,
            runner.num_accepted_tokens.gpu,
            runner.prev_positions.gpu,
            runner.prev_num_draft_tokens.gpu,
        )
    )
    host_dtype = runner.input_batch.num_computed_tokens_cpu_tensor.dtype  # copied to the device, [n]
    rows, device = int(computed.shape[0]), computed.device
    calls = 0
    with torch.inference_mode():  # as execute_model runs it: Dynamo guards the grad mode
        for n, m in WARM_SHAPES:
            n, m = min(n, rows), min(m, rows)
            fn(
                computed,
                accepted[:n],
                positions[:n],  # positions 0: row 0 of the previous step, a valid gather
                torch.ones(m, dtype=getattr(torch, VALID_COUNT_DTYPE), device=device),
                drafts,
                torch.zeros(n, dtype=host_dtype, device=device),
            )
            calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return calls


def _twin(buffer: Any) -> Any:
    """A zeroed tensor like ``buffer`` (shape, dtype, device) made in the same inference mode as ``buffer``: Dynamo's
    guards see a normal tensor and an inference tensor apart."""
    import torch

    with torch.inference_mode(buffer.is_inference()):
        return torch.zeros_like(buffer)


def worker_problem(worker_cls: Any) -> str:
    """'' if ``worker_cls`` has ``compile_or_warm_up_model``, else the reason."""
    fn = getattr(worker_cls, "compile_or_warm_up_model", None)
    return "" if callable(fn) else "Worker.compile_or_warm_up_model is missing"


def wrap_warmup(orig: Any, worker_cls: Any) -> Any:
    """``compile_or_warm_up_model`` (end): a worker whose runner drafts with our proposer under async scheduling
    compiles the correction's classes (``warm_batch_change``) after vLLM's warm-up."""

    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        runner = getattr(self, "model_runner", None)
        if runner is not None and async_patch.drafts_in_schedule_mode(runner):
            try:
                calls = warm_batch_change(runner)
            except Exception as exc:  # noqa: BLE001 - a warm-up must never stop the engine
                logger.warning(
                    "specdec: %s was not compiled ahead (%r); its first steps after one-request steps "
                    "may stall while it recompiles",
                    FUNCTION_NAME,
                    exc,
                )
            else:
                if calls:
                    logger.info("specdec: compiled %s ahead for %d batch-size classes", FUNCTION_NAME, calls)
        return out

    return compile_or_warm_up_model
