"""The numpy draft-model backend vs Hugging Face and the torch backend: logits, batching, trees, rollback, drafts."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.drafters import DraftRequest
from specdec.drafters.model import ModelDrafter, ModelDrafterConfig
from specdec.drafters.model_backends import BACKEND_NAMES, StepInput, make_backend
from specdec.drafters.model_numpy import INITIAL_CAPACITY, NumpyLlamaBackend, blas_threads
from specdec.paths import DRAFT_MODEL, model_path
from core_support import SAVED_VOCAB, hf_logits, load_hf, save_tiny_llama

VOCAB = SAVED_VOCAB
ATOL = 1e-4  # fp32 logits of a 2-layer model vs fp32 with another op order
SHARED = model_path(DRAFT_MODEL)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_numpy"), seed=11, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def hf(tiny: Path) -> torch.nn.Module:
    return load_hf(tiny)


def _close(got: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=atol, rtol=1e-4)


def test_registered() -> None:
    assert "numpy" in BACKEND_NAMES
    assert "numpy" in ModelDrafterConfig.from_dict({"backend": "numpy"}).backend


def test_prefill_then_decode_matches_hf(tiny: Path, hf: torch.nn.Module) -> None:
    """Prefill (every row wanted), then single-token decode steps (the fast path): rows equal HF's forward."""
    b = make_backend("numpy", tiny)
    assert isinstance(b, NumpyLlamaBackend) and b.vocab_size == VOCAB
    seq = np.random.default_rng(0).integers(0, VOCAB, size=9).tolist()
    st = b.new_state()
    got = [b.forward([StepInput(st, seq, list(range(9)), list(range(9)))])[0]]
    for tok in (5, 17, 96, 0, 42):
        got.append(b.forward([StepInput(st, [tok], [len(seq)], [0])])[0])
        seq.append(tok)
    assert b.length(st) == len(seq) == 14
    _close(torch.cat(got), hf_logits(hf, seq))
    # a decode step that wants no logits still appends to the cache
    assert b.forward([StepInput(st, [7], [14], [])])[0].shape == (0, VOCAB)
    assert b.length(st) == 15
    _close(b.forward([StepInput(st, [8], [15], [0])])[0][0], hf_logits(hf, seq + [7, 8])[-1])


def test_ragged_batch_matches_hf(tiny: Path, hf: torch.nn.Module) -> None:
    """3 requests of different lengths in one forward, then batched decodes and a mixed step."""
    b = make_backend("numpy", tiny)
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, VOCAB, size=n).tolist() for n in (7, 1, 12)]
    states = [b.new_state() for _ in seqs]
    got = b.forward([StepInput(s, q, list(range(len(q))), list(range(len(q)))) for s, q in zip(states, seqs)])
    for _ in range(3):
        new = rng.integers(0, VOCAB, size=len(seqs)).tolist()
        out = b.forward([StepInput(s, [t], [len(q)], [0]) for s, t, q in zip(states, new, seqs)])
        for q, t in zip(seqs, new):
            q.append(t)
        got = [torch.cat([g, o]) for g, o in zip(got, out)]
    # mixed: 2 tokens for the first request (last row only), 1 for the third, none for the second
    extra = [[3, 4], [9]]
    out = b.forward([StepInput(states[0], extra[0], [len(seqs[0]), len(seqs[0]) + 1], [1]),
                     StepInput(states[2], extra[1], [len(seqs[2])], [0])])
    seqs[0] += extra[0]
    seqs[2] += extra[1]
    for q, g in zip(seqs, got):
        _close(g, hf_logits(hf, q)[: len(g)])
    _close(out[0], hf_logits(hf, seqs[0])[-1:])
    _close(out[1], hf_logits(hf, seqs[2])[-1:])
    assert [b.length(s) for s in states] == [len(q) for q in seqs]


def test_tree_mask_matches_paths(tiny: Path, hf: torch.nn.Module) -> None:
    """Sibling nodes sharing a position and a grandchild in one masked forward = HF on each root path."""
    b = make_backend("numpy", tiny)
    ctx = [5, 9, 11, 2, 40]
    st = b.new_state()
    b.forward([StepInput(st, ctx, list(range(5)), [4])])
    mask = np.zeros((3, 8), bool)  # nodes 17 (depth 1), 23 (depth 1), 31 (child of 17): slots 5, 6, 7
    mask[:, :5] = True
    mask[0, 5] = mask[1, 6] = True
    mask[2, [5, 7]] = True
    out = b.forward([StepInput(st, [17, 23, 31], [5, 5, 6], [0, 1, 2], mask=mask)])[0]
    for row, path in enumerate([[17], [23], [17, 31]]):
        _close(out[row], hf_logits(hf, ctx + path)[-1])
    # one node below the grandchild, alone with a mask (the single-token path with a bias)
    mask1 = np.zeros((1, 9), bool)
    mask1[0, [0, 1, 2, 3, 4, 5, 7, 8]] = True
    out1 = b.forward([StepInput(st, [60], [7], [0], mask=mask1)])[0]
    _close(out1[0], hf_logits(hf, ctx + [17, 31, 60])[-1])
    with pytest.raises(ValueError, match="mask has shape"):
        b.forward([StepInput(st, [1], [8], [0], mask=np.ones((1, 3), bool))])


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
    _close(out, ref, atol=1e-5)
    _close(out, hf_logits(hf, prompt + [1, 50, 51])[11:])
    b.crop(st, 100)  # cropping past the end keeps everything
    assert b.length(st) == 13


def test_growth_beyond_initial_capacity(tmp_path: Path) -> None:
    path = save_tiny_llama(tmp_path, seed=3, max_pos=2 * INITIAL_CAPACITY + 64, rms_norm_eps=1e-5)
    hf = load_hf(path)
    b = make_backend("numpy", path)
    seq = np.random.default_rng(3).integers(0, VOCAB, size=INITIAL_CAPACITY - 2).tolist()
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
    _close(torch.cat(got), ref[rows], atol=2e-4)


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
            _close(g, w)

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
    _close(got, want, atol=1e-3)
    reruns = nb.stable_reruns
    for tok in (3, 4):  # single-token steps overflow too and take the stable path
        g = nb.forward([StepInput(n_st, [tok], [len(seq)], [0])])[0]
        w = tb.forward([StepInput(t_st, [tok], [len(seq)], [0])])[0]
        seq.append(tok)
        _close(g, w, atol=1e-3)
    assert nb.stable_reruns > reruns and nb.length(n_st) == len(seq)


def _drafter(path: Path, backend: str, **kw: object) -> ModelDrafter:
    return ModelDrafter(ModelDrafterConfig.from_dict({"path": str(path), "backend": backend, **kw}))


def test_drafter_numpy_equals_torch(tiny: Path) -> None:
    """Chains and trees over several rounds with rollback: the numpy drafter drafts what the torch one does."""
    d = {name: _drafter(tiny, name, tree_top_k=2, tree_branch_depths=[1, 2]) for name in ("numpy", "torch")}
    assert d["numpy"].backend.name == "numpy"
    rng = np.random.default_rng(6)
    prompts = {f"r{i}": rng.integers(2, VOCAB, size=5 + 6 * i).tolist() for i in range(3)}
    for dr in d.values():
        for rid, p in prompts.items():
            dr.start(rid, p)
    reqs = [DraftRequest(rid, 4 + i, tree=i == 1) for i, rid in enumerate(prompts)]
    for rnd in range(3):
        trees = {name: dr.draft_batch(reqs) for name, dr in d.items()}
        for r, a, b in zip(reqs, trees["numpy"], trees["torch"]):
            assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
            np.testing.assert_allclose(a.probs, b.probs, rtol=1e-4, atol=1e-5)
            emitted = a.tokens[: rnd + 1].tolist() + [int(rng.integers(2, VOCAB))]  # partial accept + bonus
            for dr in d.values():
                dr.extend(r.request_id, emitted)
    single = _drafter(tiny, "numpy")
    single.start("x", prompts["r0"])
    d["torch"].start("x", prompts["r0"])
    assert single.draft("x", 6).tokens.tolist() == d["torch"].draft("x", 6).tokens.tolist()
    for dr in d.values():
        dr.close()


@pytest.mark.skipif(not (SHARED / "config.json").exists(),
                    reason=f"shared draft model not at {SHARED}; put the shared folder beside the repo")
def test_shared_draft_model_matches_torch() -> None:
    nb, tb = make_backend("numpy", SHARED), make_backend("torch", SHARED)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, nb.vocab_size, size=n).tolist() for n in (40, 9)]
    ns, ts = [nb.new_state() for _ in prompts], [tb.new_state() for _ in prompts]
    got = nb.forward([StepInput(s, p, list(range(len(p))), [len(p) - 1]) for s, p in zip(ns, prompts)])
    want = tb.forward([StepInput(s, p, list(range(len(p))), [len(p) - 1]) for s, p in zip(ts, prompts)])
    for g, w in zip(got, want):
        _close(g, w)
    for step in range(4):
        tok = int(want[0][0].argmax())
        g = nb.forward([StepInput(ns[0], [tok], [40 + step], [0])])[0]
        w = tb.forward([StepInput(ts[0], [tok], [40 + step], [0])])[0]
        _close(g, w)
        want = [w]
    assert nb.stable_reruns == 0


def test_stable_softmax_path_equals_fast_path(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force the rerun (every row sum counts as underflowed): same logits as the fast path, state kept right."""
    import specdec.drafters.model_numpy as mn

    fast, slow = make_backend("numpy", tiny), make_backend("numpy", tiny)
    seq = np.random.default_rng(8).integers(0, VOCAB, size=10).tolist()
    fs, ss = fast.new_state(), slow.new_state()
    steps = [StepInput(None, seq, list(range(10)), [9])] + [StepInput(None, [t], [10 + i], [0])
                                                              for i, t in enumerate((4, 5, 6))]
    for step in steps:
        a = fast.forward([StepInput(fs, step.tokens, step.positions, step.want)])[0]
        with monkeypatch.context() as m:
            m.setattr(mn, "SUM_MIN", 1e30)
            b = slow.forward([StepInput(ss, step.tokens, step.positions, step.want)])[0]
        _close(b, a, atol=1e-5)
    assert fast.stable_reruns == 0 and slow.stable_reruns == len(steps)
    assert fast.length(fs) == slow.length(ss) == 13
