"""The native (C++) draft-model backend vs Hugging Face and the torch backend, for every SIMD width this CPU has.

Logits of prefill, decode, ragged batches, tree masks and rollback equal HF's forward; thread counts give
bit-identical logits (each output row is computed the same way whichever thread owns it); drafts equal the
torch backend's; bad inputs raise errors that name the value.
"""

from __future__ import annotations

import threading
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
from specdec.drafters.model import ModelDrafter, ModelDrafterConfig
from specdec.drafters.model_backends import BACKEND_NAMES, StepInput, make_backend
from specdec.paths import DRAFT_MODEL, model_path

native = pytest.importorskip("specdec.drafters._llama_native", reason="native extension not built")
from specdec.drafters.model_native import INITIAL_CAPACITY, NativeLlamaBackend  # noqa: E402

VOCAB = SAVED_VOCAB
SHARED = model_path(DRAFT_MODEL)


ISAS = native.isas()  # SIMD widths this CPU runs (the kernels of the others cannot be exercised here)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_native"), seed=12, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same kind of model stored in bf16 (what the shared checkpoints are): weights are kept bf16."""
    from transformers import AutoModelForCausalLM

    src = save_tiny_llama(tmp_path_factory.mktemp("tiny_llama_native_src"), seed=13, rms_norm_eps=1e-5)
    out = tmp_path_factory.mktemp("tiny_llama_native_bf16")
    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def hf(tiny: Path) -> torch.nn.Module:
    return load_hf(tiny)


def test_registered_and_described(tiny: Path) -> None:
    assert {"native", "native-fp32"} <= set(BACKEND_NAMES)
    b = make_backend("native", tiny)
    assert isinstance(b, NativeLlamaBackend) and b.vocab_size == VOCAB
    assert b.info["weights"] == "fp32"  # an fp32 checkpoint keeps fp32 weights under weights="auto"
    assert b.info["isa"] in ISAS and b.info["isa"] in b.describe()


@pytest.mark.parametrize("isa", ISAS)
def test_prefill_then_decode_matches_hf(tiny: Path, hf: torch.nn.Module, isa: str) -> None:
    check_prefill_then_decode(NativeLlamaBackend(tiny, threads=2, isa=isa), hf)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_weights_match_hf_of_the_same_weights(tiny_bf16: Path, isa: str) -> None:
    hf = load_hf(tiny_bf16)  # bf16 checkpoint widened to fp32: exactly the values the native kernels use
    b = NativeLlamaBackend(tiny_bf16, threads=3, isa=isa)
    assert b.info["weights"] == "bf16"
    seq = np.random.default_rng(1).integers(0, VOCAB, size=20).tolist()  # > one 16-token local-norm block
    st = b.new_state()
    got = b.forward([StepInput(st, seq, list(range(20)), list(range(20)))])[0]
    close(got, hf_logits(hf, seq))


def test_ragged_batch_matches_hf(tiny: Path, hf: torch.nn.Module) -> None:
    check_ragged_batch(make_backend("native", tiny), hf)


def test_tree_mask_matches_paths(tiny: Path, hf: torch.nn.Module) -> None:
    check_tree_mask(make_backend("native", tiny), hf)


def test_crop_then_redecode_equals_fresh_and_growth(tmp_path: Path) -> None:
    hf, b, prompt = past_capacity_case(tmp_path, "native", INITIAL_CAPACITY, seed=2)
    st = b.new_state()
    b.forward([StepInput(st, prompt, list(range(len(prompt))), [len(prompt) - 1])])
    n = len(prompt)
    for i, tok in enumerate([1, 2, 3, 4, 5]):  # decoded past the initial capacity, then rejected
        b.forward([StepInput(st, [tok], [n + i], [0])])
    assert b.state_bytes(st) > INITIAL_CAPACITY * 4 * 2 * 2 * 16  # grew (slot = layers * 2 * kv_heads * hd fp32)
    b.crop(st, n + 1)  # keep the first decoded token
    out = b.forward([StepInput(st, [50, 51], [n + 1, n + 2], [0, 1])])[0]
    close(out, hf_logits(hf, prompt + [1, 50, 51])[n + 1 :])
    b.crop(st, 10_000)  # cropping past the end keeps everything
    assert b.length(st) == n + 3


def test_thread_counts_are_bit_identical(tiny: Path) -> None:
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (30, 3, 17)]
    outs = []
    for threads in (1, 2, 5):
        b = NativeLlamaBackend(tiny, threads=threads)
        states = [b.new_state() for _ in prompts]
        o = b.forward([StepInput(s, p, list(range(len(p))), list(range(len(p)))) for s, p in zip(states, prompts)])
        o += b.forward([StepInput(s, [7], [len(p)], [0]) for s, p in zip(states, prompts)])
        outs.append(torch.cat(o))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_concurrent_callers_are_serialised(tiny: Path, hf: torch.nn.Module) -> None:
    """Two Python threads share one backend (GIL released inside): each gets its own correct logits."""
    b = NativeLlamaBackend(tiny, threads=2)
    seqs = [np.random.default_rng(s).integers(0, VOCAB, size=25).tolist() for s in (5, 6)]
    results: dict[int, torch.Tensor] = {}

    def run(i: int) -> None:
        st = b.new_state()
        rows = []
        for _ in range(20):
            b.crop(st, 0)
            rows = b.forward([StepInput(st, seqs[i], list(range(25)), [24])])
        results[i] = rows[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in (0, 1):
        close(results[i][0], hf_logits(hf, seqs[i])[-1])


def test_bad_inputs_name_the_value(tiny: Path) -> None:
    b = make_backend("native", tiny)
    st = b.new_state()
    with pytest.raises(ValueError, match=r"id 500 must be in \[0, 97\)"):
        b.forward([StepInput(st, [500], [0], [0])])
    with pytest.raises(ValueError, match="position 9999"):
        b.forward([StepInput(st, [1], [9999], [0])])
    with pytest.raises(ValueError, match="positions"):
        b.forward([StepInput(st, [1, 2], [0], [0])])
    assert b.length(st) == 0  # a refused call appends nothing
    with pytest.raises(ValueError, match="weights='int4' is unknown; valid: auto, bf16, fp32"):
        NativeLlamaBackend(tiny, weights="int4")
    with pytest.raises(ValueError, match="isa='neon' is unknown"):
        NativeLlamaBackend(tiny, isa="neon")


def test_drafter_native_equals_torch(tiny: Path) -> None:
    check_drafter_equals_torch(tiny, "native")


@pytest.mark.skipif(
    not (SHARED / "config.json").exists(),
    reason=f"shared draft model not at {SHARED}; put the shared folder beside the repo",
)
def test_shared_draft_model_matches_torch() -> None:
    assert check_matches_torch(SHARED, "native").info["weights"] == "bf16"  # the shared checkpoint: kept as is


@pytest.mark.parametrize("isa", ISAS)
def test_fused_topk_equals_torch_softmax_topk(tiny: Path, isa: str) -> None:
    """forward_topk ranks inside the call: same ids as torch.topk, probabilities = softmax to 1e-6."""
    b = NativeLlamaBackend(tiny, threads=2, isa=isa)
    ref = NativeLlamaBackend(tiny, threads=2, isa=isa)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (12, 5)]
    for k in (1, 3, VOCAB):
        s1, s2 = [b.new_state() for _ in prompts], [ref.new_state() for _ in prompts]
        items = lambda ss: [StepInput(s, p, list(range(len(p))), [0, len(p) - 1]) for s, p in zip(ss, prompts)]  # noqa: E731
        probs, ids = b.forward_topk(items(s1), k)
        logits = torch.cat(ref.forward(items(s2)))  # [4, V]
        want_p, want_i = torch.topk(torch.softmax(logits, -1), k, dim=-1)
        assert ids == want_i.tolist()
        np.testing.assert_allclose(probs, want_p.numpy(), rtol=2e-6, atol=1e-7)
        assert [b.length(s) for s in s1] == [len(p) for p in prompts]  # it appended like forward


def test_chunked_attention_over_long_context_matches_hf(tmp_path: Path) -> None:
    """One token over 700 positions with 8 threads: attention is split in position chunks and merged."""
    path = save_tiny_llama(tmp_path, seed=21, max_pos=1024, rms_norm_eps=1e-5)
    hf = load_hf(path)
    seq = np.random.default_rng(10).integers(0, VOCAB, size=700).tolist()
    outs = []
    for threads in (1, 8):  # 4 heads: 1 chunk per head with 1 thread, 2 chunks with 8
        b = NativeLlamaBackend(path, threads=threads)
        st = b.new_state()
        b.forward([StepInput(st, seq, list(range(700)), [699])])
        outs.append(torch.cat([b.forward([StepInput(st, [t], [700 + i], [0])])[0] for i, t in enumerate((3, 9))]))
    ref = hf_logits(hf, seq + [3, 9])[-2:]
    close(outs[0], ref, atol=2e-4)
    close(outs[1], ref, atol=2e-4)


def test_use_after_fork_fails_instead_of_hanging(tiny: Path) -> None:
    """A forked child inherits the backend object but not its worker threads: forward raises at once."""
    import multiprocessing as mp

    b = NativeLlamaBackend(tiny, threads=2)
    b.forward([StepInput(b.new_state(), [1, 2], [0, 1], [1])])  # workers started in the parent

    def child(q: mp.Queue[str]) -> None:
        try:
            b.forward([StepInput(b.new_state(), [1], [0], [0])])
            q.put("no error")
        except RuntimeError as exc:
            q.put(str(exc))

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    p.join(timeout=30)
    assert p.exitcode == 0, "the child hung or crashed"
    assert "forked process" in q.get(timeout=5)


def test_drafter_threads_go_to_the_native_pool_not_torch(tiny: Path) -> None:
    """num_threads sizes the native pool; torch's thread count (vLLM's, inside its engine) is left alone."""
    before = torch.get_num_threads()
    d = ModelDrafter(ModelDrafterConfig.from_dict({"path": str(tiny), "backend": "native", "num_threads": 3}))
    assert d.backend.info["threads"] == 3 and torch.get_num_threads() == before
    d.close()
