"""Keep a vLLM engine busy (plain greedy decoding at a fixed batch) for a while: the load for CPU benchmarks
that must be measured "while vLLM is serving" (e.g. the draft model's step latency on the GPU host's Xeon).

    python -m benchmarks.vllm_load --seconds 60 --batch 64 &      # GPU machine, vLLM staged
    python -m benchmarks.bench_draft_cpu ... --note "while vLLM serves"

Prints one line per round (tokens/s), so the log shows the engine was busy for the whole window.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from specdec.paths import TARGET_MODEL, model_path

READY_FILE_DEFAULT = "/tmp/specdec_vllm_load.ready"  # touched once the engine generates (benchmarks wait for it)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/prompts.json", help="from benchmarks.prepare_prompts")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to keep generating")
    ap.add_argument("--batch", type=int, default=64, help="requests per generate call")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--ready-file", default=READY_FILE_DEFAULT, help="touched when the first round finished")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    data = json.loads(Path(args.prompts).read_text())["datasets"]
    prompts = [p for ds in data.values() for key, group in ds.items() if key != "warmup" for p in group]
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=2048,
        gpu_memory_utilization=0.3,
        max_num_seqs=args.batch,
        seed=0,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    t_end, i = time.perf_counter() + args.seconds, 0
    while time.perf_counter() < t_end:
        chunk = [{"prompt_token_ids": prompts[(i + j) % len(prompts)]} for j in range(args.batch)]
        t0 = time.perf_counter()
        outs = llm.generate(chunk, sp, use_tqdm=False)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"vllm_load round {i // args.batch}: {n / (time.perf_counter() - t0):,.0f} tok/s", flush=True)
        Path(args.ready_file).touch()
        i += args.batch


if __name__ == "__main__":
    main()
