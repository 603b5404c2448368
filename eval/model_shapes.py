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
    "llama-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
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
