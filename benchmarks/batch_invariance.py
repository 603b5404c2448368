"""Is vLLM's own no-spec greedy output invariant to batch composition in float32? (GPU; a lossless-check control.)

A speculative method changes how many tokens each row verifies per step, so the target runs other kernel shapes
than plain decoding; where the top-2 logits of a position are nearly tied, float32 rounding differences between
shapes can flip the argmax. This control runs **no speculation only**, the same prompts alone (batch 1) and
together (batch N), and lists the prompts whose outputs differ and where. A lossless-check mismatch of a
speculative method at a position this control also flips is numerics, not drafting.

    python -m benchmarks.batch_invariance --prompts device_inputs/prompts.json --dataset code --set bs8 \
        --batch-size 8 --out $OUT/batch_invariance.json
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.bench_vllm_report import first_diffs
from specdec.paths import TARGET_MODEL, model_path

MAX_TOKENS = 128  # as the lossless check (LOSSLESS_MAX_TOKENS)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="device_inputs/prompts.json")
    ap.add_argument("--dataset", default="code")
    ap.add_argument("--set", default="bs8", help="prompt set of the dataset (warmup, bs1, bs8, ...)")
    ap.add_argument("--batch-size", type=int, default=8, help="the batched run's batch size")
    ap.add_argument("--model", default=str(model_path(TARGET_MODEL)))
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    ap.add_argument(
        "--spec",
        default="",
        help="also run this speculative config (JSON, e.g. vLLM's ngram) batched "
        "and compare it with the batch-1 no-spec outputs",
    )
    ap.add_argument("--out", default="batch_invariance.json")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    prompts = json.loads(Path(args.prompts).read_text())["datasets"][args.dataset][args.set]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=False)

    def engine(spec: dict | None) -> LLM:
        # eager, as the lossless check runs (and a second engine's CUDA-graph capture in one process trips
        # PyTorch's caching allocator)
        return LLM(
            model=args.model,
            dtype="float32",
            max_model_len=2048,
            gpu_memory_utilization=0.3,
            max_num_seqs=args.batch_size,
            seed=0,
            speculative_config=spec,
            enforce_eager=True,
        )

    def run(llm: LLM, batch: int) -> list[list[int]]:
        outs: list[list[int]] = []
        for i in range(0, len(prompts), batch):
            res = llm.generate([{"prompt_token_ids": p} for p in prompts[i : i + batch]], sp, use_tqdm=False)
            outs += [list(r.outputs[0].token_ids) for r in res]
        return outs

    llm = engine(None)
    alone, together = run(llm, 1), run(llm, args.batch_size)
    diffs = first_diffs(together, alone)
    result = {
        "dataset": args.dataset,
        "set": args.set,
        "prompts": len(prompts),
        "batch_size": args.batch_size,
        "dtype": "float32",
        "max_tokens": args.max_tokens,
        "reference": "no speculation, batch 1",
        "nospec_batched": {"identical": len(prompts) - len(diffs), "first_diffs": diffs},
    }
    if args.spec:
        del llm
        spec = json.loads(args.spec)
        sdiffs = first_diffs(run(engine(spec), args.batch_size), alone)
        result["spec_batched"] = {"spec": spec, "identical": len(prompts) - len(sdiffs), "first_diffs": sdiffs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
