"""The inflated checkpoint (``specdec.eval.inflate_model``) computes the source model's logits at a larger size."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from core_support import SAVED_SPEC, save_tiny_llama
from specdec.eval.inflate_model import InflateError, inflate, inflated_config, param_count

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}  # head_dim 16, 2 query heads per key/value head
BIG = {
    "hidden_size": 192,
    "intermediate_size": 300,
    "num_hidden_layers": 4,
    "num_attention_heads": 12,
    "num_key_value_heads": 3,
}  # 4 query heads per key/value head (transformers wants hidden_size = heads x head_dim)
VOCAB = 97
# The saved shape with SMALL's sizes, a large eps (a wrong eps scaling shows in the logits) and norms not all ones
# (so their scaling is checked per feature).
SMALL_SPEC = replace(
    SAVED_SPEC,
    vocab=VOCAB,
    hidden=SMALL["hidden_size"],
    layers=SMALL["num_hidden_layers"],
    heads=SMALL["num_attention_heads"],
    kv_heads=SMALL["num_key_value_heads"],
    max_pos=256,
    rms_norm_eps=1e-3,
    random_norms=True,
)
assert SMALL["intermediate_size"] == 2 * SMALL["hidden_size"]  # the tiny Llama's MLP width


def _logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits  # [batch, seq, vocab]


@pytest.mark.parametrize("tied", [True, False])
def test_inflated_model_gives_the_same_logits(tmp_path: Path, tied: bool) -> None:
    src = save_tiny_llama(tmp_path / "small", seed=0, spec=SMALL_SPEC, tied=tied)
    out = inflate(src, BIG, tmp_path / "big")
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in BIG} == BIG and cfg["head_dim"] == 16
    assert cfg["rms_norm_eps"] == pytest.approx(1e-3 * 64 / 192)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    small, big = _logits(src, ids), _logits(out, ids)
    assert small.abs().max() > 1.0  # not a degenerate model
    torch.testing.assert_close(big, small, rtol=1e-4, atol=1e-4)
    assert torch.equal(big.argmax(-1), small.argmax(-1))


def test_extra_weights_are_random_and_the_output_writers_zero(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = inflate(save_tiny_llama(tmp_path / "small", seed=0, spec=SMALL_SPEC, tied=True), BIG, tmp_path / "big")
    sd = load_file(str(out / "model.safetensors"))
    assert sd["model.layers.3.mlp.gate_proj.weight"].std() > 0.01  # inert layer: real work for the GPU
    assert (
        not sd["model.layers.3.mlp.down_proj.weight"].any() and not sd["model.layers.3.self_attn.o_proj.weight"].any()
    )
    assert not sd["model.embed_tokens.weight"][:, 64:].any()  # the extra features start (and stay) zero
    assert not sd["model.layers.0.self_attn.o_proj.weight"][64:].any()
    assert not sd["model.layers.0.mlp.down_proj.weight"][:, 128:].any()


def test_inflate_is_reused_when_done(tmp_path: Path) -> None:
    src = save_tiny_llama(tmp_path / "small", seed=0, spec=SMALL_SPEC, tied=True)
    out = inflate(src, BIG, tmp_path / "big")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    inflate(src, BIG, out)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    inflate(src, {**BIG, "num_hidden_layers": 3}, out)  # another shape: rebuilt
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 3


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"hidden_size": 32}, "hidden_size=32"),
        ({"num_hidden_layers": 1}, "num_hidden_layers=1"),
        ({"num_attention_heads": 12, "num_key_value_heads": 12}, "query heads per key/value head 1"),
        ({"num_attention_heads": 10, "num_key_value_heads": 4}, "not a multiple"),
    ],
)
def test_bad_shapes_name_the_key(change: dict[str, int], key: str) -> None:
    src = {**SMALL, "vocab_size": VOCAB, "head_dim": 16}
    with pytest.raises(InflateError, match=key):
        inflated_config(src, {**BIG, **change})


def test_unknown_shape_name(tmp_path: Path) -> None:
    with pytest.raises(InflateError, match="valid: llama-8b"):
        inflate(tmp_path, "llama-70b", tmp_path / "x")


def test_param_count_matches_the_model(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    for tied in (True, False):
        out = inflate(
            save_tiny_llama(tmp_path / f"s{tied}", seed=0, spec=SMALL_SPEC, tied=tied), BIG, tmp_path / f"b{tied}"
        )
        model = AutoModelForCausalLM.from_pretrained(str(out))
        assert param_count(json.loads((out / "config.json").read_text())) == model.num_parameters()


def test_inflate_in_subprocess_runs_this_module_and_returns_the_folder(monkeypatch, tmp_path) -> None:
    import specdec.eval.inflate_model as im

    calls = []
    monkeypatch.setattr(im, "INFLATE_DIR", tmp_path)
    monkeypatch.setattr(im.subprocess, "check_call", lambda cmd: calls.append(cmd))
    out = im.inflate_in_subprocess("/models/code-target-53m", "llama-8b")
    assert out == str(tmp_path / "code-target-53m-llama-8b")
    assert calls == [
        [
            im.sys.executable,
            "-m",
            "specdec.eval.inflate_model",
            "--model",
            "/models/code-target-53m",
            "--shape",
            "llama-8b",
            "--out",
            out,
        ]
    ]
