"""The numpy draft-model backend vs Hugging Face and the torch backend: logits, batching, trees, rollback, drafts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from backend_checks import (
    check_drafter_equals_torch,
    check_matches_torch,
    check_prefill_then_decode,
    check_ragged_batch,
    check_tree_mask,
    close,
    past_capacity_case,
)
from core_support import SAVED_VOCAB, hf_logits, load_hf, save_tiny_llama
from specdec.drafters.model import ModelDrafterConfig
from specdec.drafters.model_backends import BACKEND_NAMES, StepInput, make_backend
from specdec.drafters.model_numpy import INITIAL_CAPACITY, NumpyLlamaBackend, blas_threads
from specdec.paths import DRAFT_MODEL, model_path

VOCAB = SAVED_VOCAB
SHARED = model_path(DRAFT_MODEL)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_numpy"), seed=11, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def hf(tiny: Path) -> torch.nn.Module:
    return load_hf(tiny)


def test_registered() -> None:
    assert "numpy" in BACKEND_NAMES
    assert "numpy" in ModelDrafterConfig.from_dict({"backend": "numpy"}).backend


def test_prefill_then_decode_matches_hf(tiny: Path, hf: torch.nn.Module) -> None:
    b = make_backend("numpy", tiny)
    assert isinstance(b, NumpyLlamaBackend) and b.vocab_size == VOCAB
    check_prefill_then_decode(b, hf)


def test_ragged_batch_matches_hf(tiny: Path, hf: torch.nn.Module) -> None:
    check_ragged_batch(make_backend("numpy", tiny), hf)


def test_tree_mask_matches_paths(tiny: Path, hf: torch.nn.Module) -> None:
    check_tree_mask(make_backend("numpy", tiny), hf)


def test_crop_then_redecode_equals_fresh(tiny: Path, hf: torch.nn.Module) -> None:
    b = make_backend("numpy", tiny)
    prompt = np.random.default_rng(2).integers(0, VOCAB, size=10).tolist()
    st = b.new_state()
    b.forward([StepInput(st, prompt, list(range(10)), [9])])
    for i, tok in enumerate([1, 2, 3]):  # decoded, then rejected
        b.forward([StepInput(st, [tok], [10 + i], [0])])
    b.crop(st, 11)  # keep the first decoded token
    assert b.length(st) == 11
    out = b.forward([StepInput(st, [50, 51], [11, 12], [0, 1])])[0]
    fresh = b.new_state()
    ref = b.forward([StepInput(fresh, prompt + [1, 50, 51], list(range(13)), [11, 12])])[0]
    close(out, ref, atol=1e-5)
    close(out, hf_logits(hf, prompt + [1, 50, 51])[11:])
    b.crop(st, 100)  # cropping past the end keeps everything
    assert b.length(st) == 13


def test_growth_beyond_initial_capacity(tmp_path: Path) -> None:
    hf, b, seq = past_capacity_case(tmp_path, "numpy", INITIAL_CAPACITY, seed=3)
    st = b.new_state()
    got = [b.forward([StepInput(st, seq, list(range(len(seq))), [len(seq) - 1])])[0]]
    for tok in range(6):  # single-token steps across the capacity boundary
        got.append(b.forward([StepInput(st, [tok], [len(seq)], [0])])[0])
        seq.append(tok)
    more = [(10 + i) % VOCAB for i in range(INITIAL_CAPACITY)]  # one forward that needs another doubling
    got.append(b.forward([StepInput(st, more, list(range(len(seq), len(seq) + len(more))), [len(more) - 1])])[0])
    seq += more
    assert st.capacity == 4 * INITIAL_CAPACITY and b.length(st) == len(seq)
    ref = hf_logits(hf, seq)
    rows = [INITIAL_CAPACITY - 3] + list(range(INITIAL_CAPACITY - 2, INITIAL_CAPACITY + 4)) + [len(seq) - 1]
    close(torch.cat(got), ref[rows], atol=2e-4)


def test_release_and_state_bytes(tiny: Path) -> None:
    b = make_backend("numpy", tiny)
    st = b.new_state()
    b.forward([StepInput(st, [1, 2, 3], [0, 1, 2], [2])])
    s = b.shape
    assert b.state_bytes(st) == 2 * s.layers * s.kv_heads * 3 * s.head_dim * 4
    other = b.new_state()
    b.forward([StepInput(other, [4], [0], [0])])
    b.release(st)
    assert b.length(st) == 0 and b.state_bytes(st) == 0 and st.kv.size == 0
    with pytest.raises(ValueError, match="released state"):
        b.forward([StepInput(st, [1], [0], [0])])
    assert b.length(other) == 1  # other states are untouched
    for bad in ([1], [0, 2]):
        with pytest.raises(ValueError, match="must index"):
            b.forward([StepInput(other, [5] * len(bad), list(range(1, 1 + len(bad))), bad)])
    assert b.length(other) == 1
    assert b.forward([]) == []


def test_matches_torch_backend_and_restores_blas_threads(tiny: Path) -> None:
    """Same inputs through the torch backend: ragged prefill, tree step, crop, decode; BLAS setting restored."""
    nb, tb = make_backend("numpy", tiny), make_backend("torch", tiny)
    blas = blas_threads()
    before = blas.get() if blas.available else None
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (4, 15)]
    ns, ts = [nb.new_state() for _ in prompts], [tb.new_state() for _ in prompts]

    def both(make: object) -> None:
        got, want = nb.forward(make(ns)), tb.forward(make(ts))  # type: ignore[operator]
        for g, w in zip(got, want):
            close(g, w)

    both(lambda ss: [StepInput(s, p, list(range(len(p))), [len(p) - 1]) for s, p in zip(ss, prompts)])
    mask = np.ones((2, 4 + 2), bool)
    mask[0, 5] = mask[1, 4] = False  # two siblings
    both(lambda ss: [StepInput(ss[0], [7, 8], [4, 4], [0, 1], mask=mask), StepInput(ss[1], [9], [15], [0])])
    for backend, states in ((nb, ns), (tb, ts)):  # drop both siblings of the first request
        backend.crop(states[0], 4)
    both(lambda ss: [StepInput(ss[0], [8], [4], [0]), StepInput(ss[1], [10], [16], [0])])
    both(lambda ss: [StepInput(ss[1], [11], [17], [0])])
    if blas.available:
        assert blas.get() == before


def test_overflowing_scores_rerun_with_stable_softmax(tmp_path: Path) -> None:
    """Huge q/k weights: exp(score) overflows float32; the forward reruns with the max-subtracting softmax."""
    path = save_tiny_llama(tmp_path, seed=5, qk_scale=40.0, rms_norm_eps=1e-5)
    nb, tb = make_backend("numpy", path), make_backend("torch", path)
    seq = np.random.default_rng(5).integers(0, VOCAB, size=12).tolist()
    n_st, t_st = nb.new_state(), tb.new_state()
    got = nb.forward([StepInput(n_st, seq, list(range(12)), list(range(12)))])[0]
    want = tb.forward([StepInput(t_st, seq, list(range(12)), list(range(12)))])[0]
    assert nb.stable_reruns >= 1
    assert torch.isfinite(got).all()
    close(got, want, atol=1e-3)
    reruns = nb.stable_reruns
    for tok in (3, 4):  # single-token steps overflow too and take the stable path
        g = nb.forward([StepInput(n_st, [tok], [len(seq)], [0])])[0]
        w = tb.forward([StepInput(t_st, [tok], [len(seq)], [0])])[0]
        seq.append(tok)
        close(g, w, atol=1e-3)
    assert nb.stable_reruns > reruns and nb.length(n_st) == len(seq)


def test_drafter_numpy_equals_torch(tiny: Path) -> None:
    check_drafter_equals_torch(tiny, "numpy")


@pytest.mark.skipif(
    not (SHARED / "config.json").exists(),
    reason=f"shared draft model not at {SHARED}; put the shared folder beside the repo",
)
def test_shared_draft_model_matches_torch() -> None:
    assert check_matches_torch(SHARED, "numpy").stable_reruns == 0


def test_stable_softmax_path_equals_fast_path(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the rerun (every row sum counts as underflowed): same logits as the fast path, state kept right."""
    import specdec.drafters.model_numpy as mn

    fast, slow = make_backend("numpy", tiny), make_backend("numpy", tiny)
    seq = np.random.default_rng(8).integers(0, VOCAB, size=10).tolist()
    fs, ss = fast.new_state(), slow.new_state()
    steps = [StepInput(None, seq, list(range(10)), [9])] + [
        StepInput(None, [t], [10 + i], [0]) for i, t in enumerate((4, 5, 6))
    ]
    for step in steps:
        a = fast.forward([StepInput(fs, step.tokens, step.positions, step.want)])[0]
        with monkeypatch.context() as m:
            m.setattr(mn, "SUM_MIN", 1e30)
            b = slow.forward([StepInput(ss, step.tokens, step.positions, step.want)])[0]
        close(b, a, atol=1e-5)
    assert fast.stable_reruns == 0 and slow.stable_reruns == len(steps)
    assert fast.length(fs) == slow.length(ss) == 13
