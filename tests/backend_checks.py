"""Checks every draft-model backend must pass (numpy, native): logits vs Hugging Face for prefill + decode, ragged
batches and tree masks, and drafts / logits vs the torch backend. The backend test files call them with their own
model folders and backends, then test what is specific to each backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from core_support import SAVED_VOCAB, hf_logits, load_hf, save_tiny_llama
from specdec.drafters import DraftRequest
from specdec.drafters.model import ModelDrafter, ModelDrafterConfig
from specdec.drafters.model_backends import DraftBackend, StepInput, make_backend

ATOL = 1e-4  # fp32 logits vs fp32 with another op order
VOCAB = SAVED_VOCAB


def close(got: torch.Tensor, ref: torch.Tensor, atol: float = ATOL) -> None:
    assert got.dtype == torch.float32 and got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=atol, rtol=1e-4)


def check_prefill_then_decode(b: DraftBackend, hf: torch.nn.Module) -> None:
    """Prefill (every row wanted), then single-token decode steps: rows equal HF's forward; a step that wants no
    logits still appends to the cache."""
    seq = np.random.default_rng(0).integers(0, VOCAB, size=9).tolist()
    st = b.new_state()
    got = [b.forward([StepInput(st, seq, list(range(9)), list(range(9)))])[0]]
    for tok in (5, 17, 96, 0, 42):
        got.append(b.forward([StepInput(st, [tok], [len(seq)], [0])])[0])
        seq.append(tok)
    assert b.length(st) == len(seq) == 14
    close(torch.cat(got), hf_logits(hf, seq))
    assert b.forward([StepInput(st, [7], [14], [])])[0].shape == (0, VOCAB)
    assert b.length(st) == 15
    close(b.forward([StepInput(st, [8], [15], [0])])[0][0], hf_logits(hf, seq + [7, 8])[-1])


RAGGED_LENGTHS = (7, 1, 12)  # requests of different lengths in one batch (one of a single token)


def ragged_decode(
    b: DraftBackend, rng: np.random.Generator, steps: int
) -> tuple[list[Any], list[list[int]], list[torch.Tensor]]:
    """RAGGED_LENGTHS requests prefilled in one forward (every row wanted), then ``steps`` batched single-token
    decodes: (their states, their token sequences, each one's logits per position [len, vocab])."""
    seqs = [rng.integers(0, VOCAB, size=n).tolist() for n in RAGGED_LENGTHS]
    states = [b.new_state() for _ in seqs]
    got = b.forward([StepInput(s, q, list(range(len(q))), list(range(len(q)))) for s, q in zip(states, seqs)])
    for _ in range(steps):
        new = rng.integers(0, VOCAB, size=len(seqs)).tolist()
        out = b.forward([StepInput(s, [t], [len(q)], [0]) for s, t, q in zip(states, new, seqs)])
        for q, t in zip(seqs, new):
            q.append(t)
        got = [torch.cat([g, o]) for g, o in zip(got, out)]
    return states, seqs, got


def past_capacity_case(
    tmp_path: Path, name: str, capacity: int, *, seed: int
) -> tuple[torch.nn.Module, DraftBackend, list[int]]:
    """A tiny model whose positions reach past twice a backend's initial KV capacity, its HF twin, the backend,
    and a random prompt just short of that capacity."""
    path = save_tiny_llama(tmp_path, seed=3, max_pos=2 * capacity + 64, rms_norm_eps=1e-5)
    prompt = np.random.default_rng(seed).integers(0, VOCAB, size=capacity - 2).tolist()
    return load_hf(path), make_backend(name, path), prompt


def check_ragged_batch(b: DraftBackend, hf: torch.nn.Module) -> None:
    """3 requests of different lengths in one forward, then batched decodes and a mixed step."""
    states, seqs, got = ragged_decode(b, np.random.default_rng(1), steps=3)
    # mixed: 2 tokens for the first request (last row only), 1 for the third, none for the second
    extra = [[3, 4], [9]]
    out = b.forward(
        [
            StepInput(states[0], extra[0], [len(seqs[0]), len(seqs[0]) + 1], [1]),
            StepInput(states[2], extra[1], [len(seqs[2])], [0]),
        ]
    )
    seqs[0] += extra[0]
    seqs[2] += extra[1]
    for q, g in zip(seqs, got):
        close(g, hf_logits(hf, q)[: len(g)])
    close(out[0], hf_logits(hf, seqs[0])[-1:])
    close(out[1], hf_logits(hf, seqs[2])[-1:])
    assert [b.length(s) for s in states] == [len(q) for q in seqs]


def check_tree_mask(b: DraftBackend, hf: torch.nn.Module) -> None:
    """Sibling nodes sharing a position and a grandchild in one masked forward = HF on each root path; then one
    masked node alone; a mask of the wrong shape is refused."""
    import pytest

    ctx = [5, 9, 11, 2, 40]
    st = b.new_state()
    b.forward([StepInput(st, ctx, list(range(5)), [4])])
    mask = np.zeros((3, 8), bool)  # nodes 17 (depth 1), 23 (depth 1), 31 (child of 17): slots 5, 6, 7
    mask[:, :5] = True
    mask[0, 5] = mask[1, 6] = True
    mask[2, [5, 7]] = True
    out = b.forward([StepInput(st, [17, 23, 31], [5, 5, 6], [0, 1, 2], mask=mask)])[0]
    for row, path in enumerate([[17], [23], [17, 31]]):
        close(out[row], hf_logits(hf, ctx + path)[-1])
    mask1 = np.zeros((1, 9), bool)  # one node below the grandchild, alone with a mask
    mask1[0, [0, 1, 2, 3, 4, 5, 7, 8]] = True
    out1 = b.forward([StepInput(st, [60], [7], [0], mask=mask1)])[0]
    close(out1[0], hf_logits(hf, ctx + [17, 31, 60])[-1])
    with pytest.raises(ValueError, match="mask has shape"):
        b.forward([StepInput(st, [1], [8], [0], mask=np.ones((1, 3), bool))])


def _drafter(path: Path, backend: str, **kw: Any) -> ModelDrafter:
    return ModelDrafter(ModelDrafterConfig.from_dict({"path": str(path), "backend": backend, **kw}))


def check_drafter_equals_torch(path: Path, backend: str) -> None:
    """Chains and trees over several rounds with rollback: the backend's drafter drafts what the torch one does."""
    d = {name: _drafter(path, name, tree_top_k=2, tree_branch_depths=[1, 2]) for name in (backend, "torch")}
    assert d[backend].backend.name == backend
    rng = np.random.default_rng(6)
    prompts = {f"r{i}": rng.integers(2, VOCAB, size=5 + 6 * i).tolist() for i in range(3)}
    for dr in d.values():
        for rid, p in prompts.items():
            dr.start(rid, p)
    reqs = [DraftRequest(rid, 4 + i, tree=i == 1) for i, rid in enumerate(prompts)]
    for rnd in range(3):
        trees = {name: dr.draft_batch(reqs) for name, dr in d.items()}
        for r, a, c in zip(reqs, trees[backend], trees["torch"]):
            assert a.tokens.tolist() == c.tokens.tolist() and a.parents.tolist() == c.parents.tolist()
            np.testing.assert_allclose(a.probs, c.probs, rtol=1e-4, atol=1e-5)
            emitted = a.tokens[: rnd + 1].tolist() + [int(rng.integers(2, VOCAB))]  # partial accept + bonus
            for dr in d.values():
                dr.extend(r.request_id, emitted)
    single = _drafter(path, backend)
    single.start("x", prompts["r0"])
    d["torch"].start("x", prompts["r0"])
    assert single.draft("x", 6).tokens.tolist() == d["torch"].draft("x", 6).tokens.tolist()
    for dr in (*d.values(), single):
        dr.close()


def check_matches_torch(path: Path, backend: str) -> DraftBackend:
    """Prefill of two prompts, then 4 greedy decode steps: logits equal the torch backend's; returns the backend."""
    nb, tb = make_backend(backend, path), make_backend("torch", path)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, nb.vocab_size, size=n).tolist() for n in (40, 9)]
    ns, ts = [nb.new_state() for _ in prompts], [tb.new_state() for _ in prompts]
    got = nb.forward([StepInput(s, p, list(range(len(p))), [len(p) - 1]) for s, p in zip(ns, prompts)])
    want = tb.forward([StepInput(s, p, list(range(len(p))), [len(p) - 1]) for s, p in zip(ts, prompts)])
    for g, w in zip(got, want):
        close(g, w)
    for step in range(4):
        tok = int(want[0][0].argmax())
        g = nb.forward([StepInput(ns[0], [tok], [40 + step], [0])])[0]
        want = tb.forward([StepInput(ts[0], [tok], [40 + step], [0])])
        close(g, want[0])
    return nb
