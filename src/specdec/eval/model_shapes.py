"""Real-size model shapes for GPU timing runs: the shared target's tokenizer and config, resized, no weights.

``bench_vllm --shape llama-8b`` loads such a folder with vLLM's ``load_format="dummy"`` (random weights): step times
of a real size on the lent GPU. Outputs are noise (a random model tends to repeat one token), so only timings mean
anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# --shape: model configs of real sizes (random weights); keys override the shared target's config.json
SHAPES: dict[str, dict[str, Any]] = {
    "llama-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "tie_word_embeddings": False,
    },
}
# --inflate (specdec.eval.inflate_model): the shared target's weights inside a model of this size, same outputs;
# head_dim is the source's (RoPE must not change). llama-8b: Llama-3-8B's hidden/intermediate/layers
# and q width (4096 = 64 heads x 64), 8 key/value heads (512 wide; Llama-3-8B: 1024), ~7.0B parameters with the
# shared 16k vocabulary: a forward pass of an 8B model's cost.
INFLATE_SHAPES: dict[str, dict[str, int]] = {
    "llama-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
    },
}
SHAPE_DIR = Path("/tmp/specdec_shapes")


def shaped_model(model: str, shape: str) -> str:
    """``model`` itself, or a folder with its tokenizer and config resized to ``SHAPES[shape]`` (no weights)."""
    if not shape:
        return model
    src, dst = Path(model), SHAPE_DIR / shape
    dst.mkdir(parents=True, exist_ok=True)
    config = {**json.loads((src / "config.json").read_text()), **SHAPES[shape]}
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            (dst / name).write_text((src / name).read_text())
    return str(dst)
