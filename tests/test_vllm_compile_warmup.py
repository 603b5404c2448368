"""compile_warmup: vLLM's async spec-decode correction compiled ahead for every batch-size class, so no step
recompiles it later (a recompile holds the host for a large share of a second while the GPU idles)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from patch_support import patch
from specdec.vllm_plugin.attrs import WRAPPED
from specdec.vllm_plugin.modes.feed import valid_counts
from specdec.vllm_plugin.patches import compile_warmup
from specdec.vllm_plugin.patches.compile_warmup import WARM_SHAPES, warm_batch_change
from specdec.vllm_plugin.patches.features import Feature

MAX_REQS = 64  # the fake runner's max_num_reqs (R)


def _buffer(dtype: torch.dtype) -> Any:
    """vLLM's CpuGpuBuffer as the runner's call uses it: ``.gpu`` ([R], here on the CPU)."""
    return SimpleNamespace(gpu=torch.full((MAX_REQS,), 7, dtype=dtype))


def _runner(*, async_spec: bool = True) -> Any:
    """The runner fields vLLM's correction call reads, with vLLM 0.26's dtypes."""
    return SimpleNamespace(
        use_async_spec_decode=async_spec,
        num_computed_tokens=torch.full((MAX_REQS,), 5, dtype=torch.int32),
        num_accepted_tokens=_buffer(torch.int32),
        prev_positions=_buffer(torch.int64),
        prev_num_draft_tokens=_buffer(torch.int32),
        input_batch=SimpleNamespace(num_computed_tokens_cpu_tensor=torch.zeros(MAX_REQS, dtype=torch.int32)),
    )


def _real_call(fn: Any, n: int, m: int) -> None:
    """The correction called as vLLM's runner calls it at a step of n requests after one of m (values aside): in
    ``execute_model``'s inference mode, the [R] buffers whole or sliced to views of n rows, the valid counts our
    capture made in that mode, the host counts copied to the device (a new tensor; ``clone`` on the CPU). GPU run
    117 found both the mode and the views in Dynamo's guards."""
    runner = _runner()
    runner.prev_positions.gpu.zero_()  # valid gathers (vLLM's values are row indices or -1)
    with torch.inference_mode():
        fn(
            runner.num_computed_tokens,
            runner.num_accepted_tokens.gpu[:n],
            runner.prev_positions.gpu[:n],
            valid_counts(torch.zeros((m, 3), dtype=torch.int64))[1],
            runner.prev_num_draft_tokens.gpu,
            runner.input_batch.num_computed_tokens_cpu_tensor[:n].clone(),
        )


def test_each_class_is_called_once_on_scratch_tensors_of_the_runners_dtypes():
    """One call per class (n, m); the tensors are new (the runner's buffers keep their values), shaped [R] where the
    runner passes whole buffers and [n] / [m] where it slices, with its dtypes and valid_counts' dtype."""
    seen = []

    def fake(computed, accepted, positions, valid, drafts, host) -> None:
        seen.append((len(accepted), len(valid)))
        assert computed.shape == drafts.shape == (MAX_REQS,)
        assert len(positions) == len(host) == len(accepted)
        assert (computed.dtype, accepted.dtype, positions.dtype, drafts.dtype, host.dtype) == (
            torch.int32,
            torch.int32,
            torch.int64,
            torch.int32,
            torch.int32,
        )
        assert valid.dtype == valid_counts(torch.zeros((2, 3), dtype=torch.int64))[1].dtype
        computed += 1  # scratch: the runner must not see this

    runner = _runner()
    assert warm_batch_change(runner, fake) == len(WARM_SHAPES)
    assert seen == list(WARM_SHAPES)
    assert bool((runner.num_computed_tokens == 5).all()) and bool((runner.num_accepted_tokens.gpu == 7).all())
    assert warm_batch_change(_runner(async_spec=False), fake) == 0 and len(seen) == len(WARM_SHAPES)


def test_after_the_warm_up_no_step_recompiles_vllms_function():
    """On a real vLLM (CI's vLLM venv): vLLM's own function, compiled as vLLM compiles it (dynamic=True) with a
    backend that counts compilations, recompiles on a natural run's batch changes; warmed first, it compiles the
    four classes and then never again, whatever (n, m) the steps bring."""
    spec_utils = pytest.importorskip("vllm.v1.spec_decode.utils")
    original = spec_utils.update_num_computed_tokens_for_batch_change._torchdynamo_orig_callable
    natural = [(32, 32), (32, 28), (64, 64), (32, 1), (1, 1), (2, 1), (1, 5)]
    later = [(32, 1), (1, 1), (32, 32), (64, 64), (5, 17), (64, 1), (1, 64), (2, 2), (63, 64), (64, 2)]

    def compiled() -> tuple[Any, list[int]]:
        count = [0]

        def backend(gm: Any, example_inputs: Any) -> Any:
            count[0] += 1
            return gm.forward

        torch._dynamo.reset()
        return torch.compile(original, dynamic=True, backend=backend), count

    fn, count = compiled()
    for n, m in natural:
        _real_call(fn, n, m)
    assert count[0] >= 4  # unwarmed: a compile at the first call, then recompiles mid-run
    fn, count = compiled()
    assert warm_batch_change(_runner(), fn) == len(WARM_SHAPES) and count[0] == len(WARM_SHAPES)
    for n, m in later + natural:
        _real_call(fn, n, m)
    assert count[0] == len(WARM_SHAPES)


def test_the_worker_patch_warms_only_runners_that_draft_with_us_and_never_raises(monkeypatch):
    """``compile_or_warm_up_model`` keeps its result; the warm-up runs after it for our proposer under async
    scheduling only; a failing warm-up is logged, not raised; patching twice wraps once."""
    calls = []

    class Worker:
        def __init__(self, runner: Any) -> None:
            self.model_runner = runner

        def compile_or_warm_up_model(self) -> str:
            calls.append("vllm")
            return "times"

    ours = {"yes": True}
    monkeypatch.setattr(compile_warmup.async_patch, "drafts_in_schedule_mode", lambda runner: ours["yes"])
    monkeypatch.setattr(compile_warmup, "warm_batch_change", lambda runner: calls.append("warm") or 4)
    assert patch(Worker, Feature.COMPILE_WARMUP).on(Feature.COMPILE_WARMUP)
    first = Worker.compile_or_warm_up_model
    assert patch(Worker, Feature.COMPILE_WARMUP).on(Feature.COMPILE_WARMUP) and Worker.compile_or_warm_up_model is first
    assert Worker(object()).compile_or_warm_up_model() == "times" and calls == ["vllm", "warm"]
    ours["yes"] = False
    calls.clear()
    assert Worker(object()).compile_or_warm_up_model() == "times" and calls == ["vllm"]

    def broken(runner: Any) -> int:
        raise RuntimeError("no compiler")

    ours["yes"] = True
    monkeypatch.setattr(compile_warmup, "warm_batch_change", broken)
    assert Worker(object()).compile_or_warm_up_model() == "times"


def test_vllms_worker_and_runner_still_have_what_the_warm_up_uses():
    """On a real vLLM (CI's vLLM venv): the worker method it wraps and the function it warms exist."""
    gpu_worker = pytest.importorskip("vllm.v1.worker.gpu_worker")
    assert callable(compile_warmup.batch_change_function())
    assert hasattr(gpu_worker.Worker, "compile_or_warm_up_model")


def test_the_table_row_wraps_vllms_worker_once(monkeypatch):
    """On a real vLLM (CI's vLLM venv): the patch table's "compile warm-up" row fits vLLM's ``Worker`` and wraps
    ``compile_or_warm_up_model`` (restored after the test) once, keeping its signature."""
    import inspect

    gpu_worker = pytest.importorskip("vllm.v1.worker.gpu_worker")
    from specdec.vllm_plugin.patches.table import TABLE, WORKER, apply_row

    row = next(r for r in TABLE if r.feature is Feature.COMPILE_WARMUP)
    assert row.target == WORKER and row.method == "compile_or_warm_up_model" and row.stage == "worker"
    before = inspect.signature(gpu_worker.Worker.compile_or_warm_up_model)
    monkeypatch.setattr(gpu_worker.Worker, "compile_or_warm_up_model", gpu_worker.Worker.compile_or_warm_up_model)
    assert apply_row(row, in_span=True) == ""
    wrapped = gpu_worker.Worker.compile_or_warm_up_model
    assert getattr(wrapped, WRAPPED) and inspect.signature(wrapped) == before
    assert apply_row(row, in_span=True) == "" and gpu_worker.Worker.compile_or_warm_up_model is wrapped
