"""A vLLM check, not a plugin one: greedy-equivalent sampling (temperature 1, a ``top_p`` below float32's epsilon)
against greedy, on a no-speculation server with one request at a time and with 8 at once, and on vLLM ngram
verifying 16 draft tokens (GPU, vLLM 0.26; the shared 53M target, float32, eager).

    OUT=/tmp/out python -m benchmarks.vllm_top_p_check     # writes $OUT/vllm_top_p_check.json

vLLM samples batches of 8+ rows with a Triton top-k / top-p kernel and fewer with PyTorch; the rejection sampler
counts every draft position as a row, so speculation with k >= 7 takes the Triton path even for one request.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.serve_common import METHODS, Server, device_name, free_port, write_json
from benchmarks.serve_features import load_prompts
from specdec.eval.results import installed_versions

TOP_P = 1e-9
PROMPTS = 8
MAX_TOKENS = 64
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--gpu-memory-utilization", "0.3", "--enforce-eager"]
CONFIGS = {"nospec": None, "ngram16": {**METHODS["ngram"], "num_speculative_tokens": 16}}


def check(base_url: str, model: str, prompts: list[str]) -> dict[str, Any]:
    import openai

    c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)

    def one(p: str, **kw: Any) -> Any:
        return c.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, **kw).choices[0]

    greedy = [one(p, temperature=0.0).text for p in prompts]
    alone = [one(p, temperature=1.0, top_p=TOP_P) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: one(p, temperature=1.0, top_p=TOP_P), prompts))
    return {
        "alone_identical": sum(a.text == g for a, g in zip(alone, greedy)),
        "together_identical": sum(a.text == g for a, g in zip(together, greedy)),
        "alone_finish": [a.finish_reason for a in alone],
        "together_finish": [a.finish_reason for a in together],
        "together_chars": [len(a.text) for a in together],
        "greedy_chars": [len(g) for g in greedy],
    }


def main() -> int:
    from specdec.paths import TARGET_MODEL, model_path

    out_dir = Path(os.environ.get("OUT", "eval/results/serve"))
    model = str(model_path(TARGET_MODEL))
    prompts = load_prompts(Path("device_inputs/serve_prompts.json"))[:PROMPTS]
    doc: dict[str, Any] = {"command": "python -m benchmarks.vllm_top_p_check", "device": device_name(),
                           "versions": installed_versions(), "top_p": TOP_P, "server_args": SERVER_ARGS}  # fmt: skip
    for name, spec in CONFIGS.items():
        srv = Server(model, port=free_port(), log=out_dir / f"{name}.log", spec=spec, server_args=SERVER_ARGS)
        try:
            srv.start(300)
            doc[name] = check(srv.base_url, model, prompts)
            print(name, json.dumps(doc[name]), flush=True)
        finally:
            srv.stop()
    write_json(out_dir / "vllm_top_p_check.json", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
