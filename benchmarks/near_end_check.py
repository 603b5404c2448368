"""The long prompt near max_model_len on a GPU, with specdec's patch row for vLLM's guard off or on.

    python -m benchmarks.near_end_check off     # vLLM's guard as it is (NEAR_END_ON False)
    python -m benchmarks.near_end_check on      # the patch row applied, as shipped

One in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the constant set here reaches the model runner) on
the shared 53M target in float32 at max_model_len 1024, eager; two greedy requests of 7 tokens: serve_features' long
prompt (max_model_len - 8 tokens, a unit repeated, whose continuation the target copies) and the same text cut to
900 tokens (far from the end: the control). Prints one ``NEAREND`` line (JSON): the outputs and vLLM's spec-decode
counters. With the row off, vLLM runs no drafter while a sequence is within k of max_model_len and verifies zeros.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CONTROL_TOKENS = 900  # the control prompt's length: far from max_model_len


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["off"], ["on"]):
        raise SystemExit("usage: python -m benchmarks.near_end_check off|on")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM starts its engine
    from vllm import LLM, SamplingParams

    from benchmarks.gate_proxy import variant
    from benchmarks.long_prompt import NEW_TOKENS
    from benchmarks.serve_feature_checks import MAX_MODEL_LEN
    from benchmarks.serve_features import load_prompts, long_prompt_ids, long_prompt_offset
    from specdec.paths import TARGET_MODEL, model_path

    model = str(model_path(TARGET_MODEL))
    ids = long_prompt_ids(model, load_prompts(Path("device_inputs/serve_prompts.json")), offset=long_prompt_offset())
    with variant({"runner.NEAR_END_ON": args[0] == "on"}):  # the patch table is applied as the engine is built
        llm = LLM(
            model,
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            gpu_memory_utilization=0.3,
            enforce_eager=True,
            speculative_config={"method": "specdec"},
            seed=0,
            disable_log_stats=False,  # the counters get_metrics() reads
        )
    outs = {}
    near_end = ids[-(MAX_MODEL_LEN - NEW_TOKENS - 1) :]  # the feature's drafting case, as long_prompt picked it
    for name, prompt in (("near_end", near_end), ("control", ids[-CONTROL_TOKENS:])):
        res = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
        outs[name] = list(res[0].outputs[0].token_ids)
    counters = {m.name: m.value for m in llm.get_metrics() if "spec_decode" in m.name and hasattr(m, "value")}
    print("NEAREND", args[0], json.dumps({"out": outs, "metrics": counters}), flush=True)


if __name__ == "__main__":
    main()
