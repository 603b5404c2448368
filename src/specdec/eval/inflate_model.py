"""Inflate a small Llama checkpoint to a real model's size without changing what it computes.

Why: the shared 53M target is so small that every vLLM engine step is bound by host work (scheduling, input
preparation), so "GPU time waiting for drafts" measures vLLM's Python rather than the drafter. A random-weight
8B shape (``bench_vllm --shape``) has real step times but emits one token forever. An *inflated* model has both:
the 53M target's weights placed inside an 8B-sized Llama whose extra parts cannot reach the output, so it emits the
53M target's text (real acceptance) at the cost of an 8B forward pass (real step times).

How, for source width ``d`` and target width ``D`` (all exact in real arithmetic; bf16 kernels may round a
little differently because the sums are longer):

* hidden state: the source's ``d`` features, then ``D - d`` features that stay zero in every layer (embedding
  columns zero; rows of ``o_proj``/``down_proj`` that write them zero);
* RMSNorm over ``D`` features of which ``D - d`` are zero: mean(x^2) shrinks by ``d/D``, so the norm weights are
  scaled by ``sqrt(d/D)`` and ``rms_norm_eps`` by ``d/D``: ``w sqrt(d/D) / sqrt(m d/D + eps d/D) = w / sqrt(m + eps)``;
* attention: same ``head_dim`` (RoPE unchanged); source query head ``h`` (key/value head ``h // g``, ``g`` = source
  group size) becomes head ``(h // g) * G + h % g`` (``G`` = target group size >= g), so it reads the same
  key/value head; extra heads attend to something but their ``o_proj`` columns are zero;
* MLP: the source's intermediate units first, extra units' ``down_proj`` columns zero;
* extra layers: ``o_proj`` and ``down_proj`` zero, so they add nothing to the residual stream.

Stored in the source's dtype: for a bf16 source the scaled norm weights round (relative 2^-9), so logits move by
~0.3% (the shared 53M target inflated 4x wide in float32: greedy continuations and argmaxes unchanged).

Weights that cannot reach the output are random (std ``INIT_STD``), not zero, so the GPU does ordinary work.

    specdec-inflate --model ../shared/models/code-target-53m --shape llama-8b --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from specdec.eval.model_shapes import INFLATE_SHAPES, SHAPE_DIR

INIT_STD = 0.02  # std of the weights that cannot reach the output
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MARKER = "inflated.json"  # written last: a folder without it is incomplete
INFLATE_DIR = SHAPE_DIR  # where the benchmark builds inflated checkpoints


class InflateError(ValueError):
    """A target shape that cannot hold the source model (names the offending key)."""


def _check(src: dict[str, Any], dst: dict[str, int]) -> None:
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
        if dst[key] < src[key]:
            raise InflateError(
                f"{key}={dst[key]} is smaller than the source's {src[key]}: a target must be at least "
                "as large in every dimension"
            )
    if dst["num_attention_heads"] % dst["num_key_value_heads"]:
        raise InflateError(
            f"num_attention_heads={dst['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads={dst['num_key_value_heads']}"
        )
    g = src["num_attention_heads"] // src["num_key_value_heads"]
    big_g = dst["num_attention_heads"] // dst["num_key_value_heads"]
    if big_g < g:
        raise InflateError(
            f"query heads per key/value head {big_g} < the source's {g}: raise num_attention_heads "
            "or lower num_key_value_heads"
        )


def inflated_config(src: dict[str, Any], shape: dict[str, int]) -> dict[str, Any]:
    """The target's config.json: ``src`` resized to ``shape``, head_dim kept, eps scaled by ``d/D``."""
    _check(src, shape)
    head_dim = src.get("head_dim") or src["hidden_size"] // src["num_attention_heads"]
    eps = src.get("rms_norm_eps", 1e-6) * src["hidden_size"] / shape["hidden_size"]
    return {**src, **shape, "head_dim": head_dim, "rms_norm_eps": eps}


def _head_rows(src: dict[str, Any], dst: dict[str, Any]) -> list[int]:
    """Target query-head index of each source query head (same key/value head)."""
    g = src["num_attention_heads"] // src["num_key_value_heads"]
    big_g = dst["num_attention_heads"] // dst["num_key_value_heads"]
    return [(h // g) * big_g + h % g for h in range(src["num_attention_heads"])]


class _Maker:
    """Random and zero tensors on one device / dtype."""

    def __init__(self, *, device: str, dtype: torch.dtype, seed: int) -> None:
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def rand(self, *shape: int) -> torch.Tensor:
        out = torch.empty(*shape, device=self.device, dtype=self.dtype)
        return out.normal_(0.0, INIT_STD, generator=self.gen)

    def zeros(self, *shape: int) -> torch.Tensor:
        return torch.zeros(*shape, device=self.device, dtype=self.dtype)


def _attention(
    w: dict[str, torch.Tensor], src: dict[str, Any], dst: dict[str, Any], mk: _Maker
) -> dict[str, torch.Tensor]:
    hd, d, big_d = dst["head_dim"], src["hidden_size"], dst["hidden_size"]
    q = mk.rand(dst["num_attention_heads"] * hd, big_d)  # [Hq' * hd, D]
    o = mk.zeros(big_d, dst["num_attention_heads"] * hd)  # [D, Hq' * hd]
    for h, t in enumerate(_head_rows(src, dst)):
        q[t * hd : (t + 1) * hd, :d] = w["q_proj"][h * hd : (h + 1) * hd]
        o[:d, t * hd : (t + 1) * hd] = w["o_proj"][:, h * hd : (h + 1) * hd]
    out = {"q_proj": q, "o_proj": o}
    for name in ("k_proj", "v_proj"):
        kv = mk.rand(dst["num_key_value_heads"] * hd, big_d)  # [Hk' * hd, D]
        kv[: w[name].shape[0], :d] = w[name]
        out[name] = kv
    return out


def _mlp(w: dict[str, torch.Tensor], src: dict[str, Any], dst: dict[str, Any], mk: _Maker) -> dict[str, torch.Tensor]:
    d, big_d, i, big_i = src["hidden_size"], dst["hidden_size"], src["intermediate_size"], dst["intermediate_size"]
    out = {}
    for name in ("gate_proj", "up_proj"):
        t = mk.rand(big_i, big_d)  # [I', D]
        t[:i, :d] = w[name]
        out[name] = t
    down = mk.zeros(big_d, big_i)  # [D, I']
    down[:d, :i] = w["down_proj"]
    out["down_proj"] = down
    return out


def inflate_state_dict(
    sd: dict[str, torch.Tensor], src: dict[str, Any], dst: dict[str, Any], *, device: str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """HF Llama state dict of ``src``'s config -> one of ``dst`` (from ``inflated_config``) computing the same."""
    dtype = sd["model.embed_tokens.weight"].dtype
    mk = _Maker(device=device, dtype=dtype, seed=seed)
    d, big_d = src["hidden_size"], dst["hidden_size"]
    scale = math.sqrt(d / big_d)
    get = lambda k: sd[k].to(device)  # noqa: E731

    def norm(key: str | None) -> torch.Tensor:
        w = torch.full((big_d,), scale, device=device, dtype=dtype)
        if key is not None:
            w[:d] = get(key) * scale
        return w

    out: dict[str, torch.Tensor] = {}
    emb = mk.zeros(src["vocab_size"], big_d)
    emb[:, :d] = get("model.embed_tokens.weight")
    out["model.embed_tokens.weight"] = emb
    if not src.get("tie_word_embeddings", False):
        head = mk.zeros(src["vocab_size"], big_d)
        head[:, :d] = get("lm_head.weight")
        out["lm_head.weight"] = head
    out["model.norm.weight"] = norm("model.norm.weight")
    for layer in range(dst["num_hidden_layers"]):
        pre, real = f"model.layers.{layer}.", layer < src["num_hidden_layers"]
        if real:
            attn = _attention(
                {n: get(f"{pre}self_attn.{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "o_proj")}, src, dst, mk
            )
            mlp = _mlp({n: get(f"{pre}mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")}, src, dst, mk)
        else:  # inert layer: writes nothing to the residual stream
            hd = dst["head_dim"]
            attn = {
                "q_proj": mk.rand(dst["num_attention_heads"] * hd, big_d),
                "k_proj": mk.rand(dst["num_key_value_heads"] * hd, big_d),
                "v_proj": mk.rand(dst["num_key_value_heads"] * hd, big_d),
                "o_proj": mk.zeros(big_d, dst["num_attention_heads"] * hd),
            }
            mlp = {
                "gate_proj": mk.rand(dst["intermediate_size"], big_d),
                "up_proj": mk.rand(dst["intermediate_size"], big_d),
                "down_proj": mk.zeros(big_d, dst["intermediate_size"]),
            }
        out.update({f"{pre}self_attn.{n}.weight": t for n, t in attn.items()})
        out.update({f"{pre}mlp.{n}.weight": t for n, t in mlp.items()})
        for name in ("input_layernorm", "post_attention_layernorm"):
            out[f"{pre}{name}.weight"] = norm(f"{pre}{name}.weight" if real else None)
    return out


def inflate(
    model: str | Path, shape: str | dict[str, int], out: str | Path, *, device: str = "cpu", seed: int = 0
) -> Path:
    """Write the inflated checkpoint of ``model`` to ``out`` (config, tokenizer files, one safetensors file);
    a no-op when ``out`` already holds the same inflation (``MARKER``). Returns ``out``."""
    from safetensors.torch import load_file, save_file

    src_dir, out = Path(model), Path(out)
    if isinstance(shape, str) and shape not in INFLATE_SHAPES:
        raise InflateError(f"shape {shape!r} is unknown; valid: {', '.join(INFLATE_SHAPES)}")
    target = INFLATE_SHAPES[shape] if isinstance(shape, str) else shape
    stamp = {"source": str(src_dir.resolve()), "shape": target, "seed": seed}
    if (out / MARKER).exists() and json.loads((out / MARKER).read_text()) == stamp:
        return out
    src = json.loads((src_dir / "config.json").read_text())
    dst = inflated_config(src, target)
    sd = load_file(str(src_dir / "model.safetensors"))
    big = inflate_state_dict(sd, src, dst, device=device, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).unlink(missing_ok=True)
    save_file(
        {k: v.contiguous().cpu() for k, v in big.items()}, str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "config.json").write_text(json.dumps(dst, indent=1))
    for name in COPY_FILES:
        if (src_dir / name).exists():
            shutil.copyfile(src_dir / name, out / name)
    (out / MARKER).write_text(json.dumps(stamp))
    return out


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a Llama config (embeddings counted once when tied)."""
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    h, i = config["hidden_size"], config["intermediate_size"]
    attn = h * hd * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    layer = attn + 3 * h * i + 2 * h
    emb = config["vocab_size"] * h * (1 if config.get("tie_word_embeddings", False) else 2)
    return config["num_hidden_layers"] * layer + emb + h


def inflate_in_subprocess(model: str, shape: str) -> str:
    """``model`` inflated to ``shape`` under ``INFLATE_DIR``, built by this module's command in a process of its own
    (so the GPU memory it used is freed before an engine starts). Returns the inflated folder."""
    out = INFLATE_DIR / f"{Path(model).name}-{shape}"
    cmd = [sys.executable, "-m", "specdec.eval.inflate_model", "--model", model, "--shape", shape, "--out", str(out)]
    subprocess.check_call(cmd)
    return str(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="source HF Llama folder (one model.safetensors)")
    ap.add_argument("--shape", default="llama-8b", choices=tuple(INFLATE_SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    out = inflate(args.model, args.shape, args.out, device=args.device)
    cfg = json.loads((out / "config.json").read_text())
    print(f"{out}: {param_count(cfg) / 1e9:.2f}B parameters in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
