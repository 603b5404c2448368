"""Draft-model backends vs Hugging Face logits (reference-vs-fast), KV pool bookkeeping, CPU detection, auto pick."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from backend_checks import ragged_decode
from core_support import SAVED_VOCAB, hf_logits, load_hf, save_tiny_llama
from specdec.drafters.cpu_info import apply_placement, parse_cpuinfo
from specdec.drafters.model import ModelDrafter, ModelDrafterConfig, auto_candidates
from specdec.drafters.model_backends import StepInput, make_backend
from specdec.drafters.model_llama import INITIAL_CAPACITY, INITIAL_ROWS, LlamaShape

VOCAB = SAVED_VOCAB
FP32_ATOL = 2e-4  # logits of a 2-layer model, fp32 vs fp32 with different op order


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_b"), seed=3)
    old = os.environ.get("SPECDEC_CACHE")
    os.environ["SPECDEC_CACHE"] = str(tmp_path_factory.mktemp("onnx_cache"))  # exports of this test only
    yield path
    if old is None:
        os.environ.pop("SPECDEC_CACHE", None)
    else:
        os.environ["SPECDEC_CACHE"] = old


@pytest.fixture(scope="module")
def hf(tiny: Path) -> torch.nn.Module:
    return load_hf(tiny)


@pytest.mark.parametrize(
    "name,atol", [("torch", FP32_ATOL), ("onnx", FP32_ATOL), ("torch-bf16", None), ("onnx-int8", None)]
)
def test_backend_matches_hf_logits(tiny: Path, hf: torch.nn.Module, name: str, atol: float | None) -> None:
    """Ragged batched prefill then batched decode steps: every row's logits equal HF's full forward."""
    b = make_backend(name, tiny)
    states, seqs, got = ragged_decode(b, np.random.default_rng(0), steps=4)
    for q, g in zip(seqs, got):
        ref = hf_logits(hf, q)
        if atol is not None:
            torch.testing.assert_close(g, ref, atol=atol, rtol=1e-4)
        else:  # approximate backends: most argmaxes agree and logits stay close relative to their spread
            agree = float((g.argmax(-1) == ref.argmax(-1)).float().mean())
            assert agree >= 0.8, f"{name}: top-1 agreement {agree:.2f}"
            assert float((g - ref).abs().mean()) < 0.1 * float(ref.std())
    assert [b.length(s) for s in states] == [len(q) for q in seqs]


def test_tree_mask_forward_matches_paths(tiny: Path, hf: torch.nn.Module) -> None:
    """Two sibling nodes and a grandchild in one masked forward = the HF forward of each root path."""
    b = make_backend("torch", tiny)
    ctx = [5, 9, 11, 2, 40]
    st = b.new_state()
    b.forward([StepInput(st, ctx, list(range(5)), [4])])
    # nodes: 0 = 17 (depth 1), 1 = 23 (depth 1), 2 = 31 (child of 0); slots 5, 6, 7
    mask = np.zeros((3, 8), bool)
    mask[:, :5] = True
    mask[0, 5] = mask[1, 6] = True
    mask[2, [5, 7]] = True
    out = b.forward([StepInput(st, [17, 23, 31], [5, 5, 6], [0, 1, 2], mask=mask)])[0]
    for row, path in enumerate([[17], [23], [17, 31]]):
        torch.testing.assert_close(out[row], hf_logits(hf, ctx + path)[-1], atol=FP32_ATOL, rtol=1e-4)


def test_pool_grows_and_compacts(tiny: Path, hf: torch.nn.Module) -> None:
    """More requests than rows, contexts past the initial capacity, stops in the middle: caches stay right."""
    d = ModelDrafter(ModelDrafterConfig(path=str(tiny), backend="torch"))
    rng = np.random.default_rng(7)
    n = INITIAL_ROWS + 2
    prompts = {
        f"r{i}": rng.integers(0, VOCAB, size=INITIAL_CAPACITY + 20 * i if i % 3 == 0 else 9).tolist() for i in range(n)
    }
    for rid, p in prompts.items():
        d.start(rid, p)
    d.draft_batch([d_req for d_req in _reqs(prompts)])
    for rid in ("r0", "r2"):
        d.stop(rid)
        prompts.pop(rid)
    trees = d.draft_batch(_reqs(prompts))
    for (rid, p), t in zip(prompts.items(), trees):
        want = hf_logits(hf, p)[-1].argmax()
        assert int(t.tokens[0]) == int(want), rid
    assert sorted(s.row for s in (d._reqs[r].state for r in prompts)) == list(range(len(prompts)))
    assert d.memory_bytes() > 0


def _reqs(prompts: dict[str, list[int]]) -> list:
    from specdec.drafters.base import DraftRequest

    return [DraftRequest(rid, 3) for rid in prompts]


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    cfg = {
        "model_type": "llama",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5},
        "num_attention_heads": 4,
        "vocab_size": 10,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "intermediate_size": 8,
    }
    with pytest.raises(ValueError, match="rope_type='llama3'.*backend='eager'"):
        LlamaShape.from_config(cfg, tmp_path)


def test_cpu_flags_parsed_and_placement(caplog: pytest.LogCaptureFixture) -> None:
    name, flags = parse_cpuinfo(
        "processor : 0\nmodel name : Intel Xeon X\nflags : fpu avx512f amx_bf16 amx_tile\n"
        "processor : 1\nflags : other\n"
    )
    assert name == "Intel Xeon X" and {"amx_bf16", "amx_tile", "avx512f"} <= flags and "other" not in flags
    assert "torch-bf16" in auto_candidates({"amx_bf16": True}) and "torch-bf16" not in auto_candidates({})
    # beside a busy vLLM: no backend with torch OpenMP threads (measured to collapse under that load)
    assert set(auto_candidates({"amx_bf16": True}, shared_host=True)) == {"native", "onnx", "numpy"}
    before = torch.get_num_threads()
    try:
        info = apply_placement(num_threads=1, cpu_affinity=sorted(os.sched_getaffinity(0)))
        assert torch.get_num_threads() == 1 and info.usable_cpus >= 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu_affinity=.*usable CPU ids"):
        apply_placement(cpu_affinity=[100000])


def test_auto_picks_a_measured_backend(tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="specdec.drafters.model"):
        d = ModelDrafter(ModelDrafterConfig(path=str(tiny), backend="auto", calibration_steps=2))
    assert d.backend.name in ("native", "torch", "onnx", "eager", "torch-bf16")
    report = [r.getMessage() for r in caplog.records if "backend=auto picked" in r.getMessage()]
    assert report and "ms/step" in report[0] and d.backend.name in report[0]
