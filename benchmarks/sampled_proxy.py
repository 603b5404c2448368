"""A CPU proxy of the GPU gate's sampled cell (``code/s8``: 8 code prompts, temperature ``SAMPLED_TEMPERATURE``, a
closed batch of 8): the same prompts with the shared 53M target's own samples at that temperature as outputs, over
``--seeds`` sample sets, through vLLM 0.26's real ``AsyncScheduler`` and the plugin's real proposer in schedule mode
(``benchmarks.vllm_cpu_engine``), once per variant (``gate_proxy.VARIANTS``).

    python -m benchmarks.sampled_proxy [--variants base,off] [--seeds 8] [--out F]

A draft token is accepted where it equals the sample, which is how often rejection sampling accepts a token drafted
with certainty (its probability under the target). One GPU run of the cell is one sample set of eight requests, too
few to tell two back-off rules apart; here every variant replays the same ``--seeds`` sets (one closed batch each, in
one engine: the suffix drafter's global cache carries over as in the gate's engine) and the difference in accepted
tokens is paired by set. Samples: Hugging Face, float32, EOS respected (``max_tokens`` the cell's), cached in
``device_inputs/sampled_proxy_targets.json`` (git-ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.gate_proxy import (
    DEFAULT_INPUTS,
    EOS,
    MAX_BATCHED,
    MAX_LEN,
    VARIANTS,
    cached,
    load_target,
    run_cell,
    run_variants,
    sample,
    target_engine,
    variant_names,
    write_doc,
)
from benchmarks.gate_worker import SAMPLED_TEMPERATURE
from specdec.paths import REPO_ROOT, TARGET_MODEL

DEFAULT_TARGETS = REPO_ROOT / "device_inputs" / "sampled_proxy_targets.json"
SEEDS, SEED = 8, 0
COLS = ("engine_steps", "drafted_steps", "drafted", "accepted", "back_offs", "recoveries", "withheld")


def samples(items: list[dict[str, Any]], seeds: int, path: Path, *, seed: int = SEED) -> list[list[list[int]]]:
    """``seeds`` sample sets: set j holds one sample per prompt of ``items`` (each ``ids`` with its ``max_tokens``),
    ending at its first EOS (kept, as vLLM emits it); cached at ``path`` by the prompts, ``seeds`` and ``seed``."""
    cells = json.dumps([(it["ids"], it["max_tokens"]) for it in items])
    key = f"{TARGET_MODEL}:{SAMPLED_TEMPERATURE}:{seeds}:{seed}:{hashlib.sha1(cells.encode()).hexdigest()[:16]}"
    per_prompt: list[list[list[int]]] = cached(path, key, lambda: _generate(items, seeds, seed))  # [prompt][seed]
    return [[per_prompt[p][j] for p in range(len(items))] for j in range(seeds)]


def _generate(items: list[dict[str, Any]], seeds: int, seed: int) -> list[list[list[int]]]:
    """Per prompt, ``seeds`` samples of the target (one ``generate`` call each: equal lengths, no padding)."""
    import torch
    from tqdm import tqdm

    model = load_target()
    torch.manual_seed(seed)
    out = []
    for it in tqdm(items, desc="target samples", unit="prompt"):
        rows = sample(
            model,
            torch.tensor([it["ids"]]),  # [1, prompt]
            temperature=SAMPLED_TEMPERATURE,
            max_new_tokens=int(it["max_tokens"]),
            num_return_sequences=seeds,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )  # [seeds] new tokens each
        out.append([_until_eos(row) for row in rows])
    return out


def _until_eos(tokens: list[int]) -> list[int]:
    """``tokens`` up to and with the first EOS (``generate`` pads finished rows with it)."""
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def replay(items: list[dict[str, Any]], sets: list[list[list[int]]], options: dict[str, Any] | None) -> list[dict]:
    """One engine through every sample set, one closed batch each: per set the plugin's counters over it."""
    engine = target_engine(options, max_len=MAX_LEN, max_seqs=len(items), max_batched=MAX_BATCHED)
    try:
        return [run_cell(engine, f"s{j}", items, outs, batch=len(items)) for j, outs in enumerate(sets)]
    finally:
        engine.close()


def paired(results: dict[str, list[dict]], base: str, col: str) -> dict[str, dict[str, float]]:
    """Per variant, ``col`` summed over the sets and its difference to ``base`` paired by set: mean, standard error,
    and the sets where it is lower / higher."""
    out = {}
    for v, runs in results.items():
        diffs = [r[col] - b[col] for r, b in zip(runs, results[base])]
        se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
        out[v] = {
            "total": sum(r[col] for r in runs),
            "mean_diff": statistics.fmean(diffs),
            "se": se,
            "lower": sum(d < 0 for d in diffs),
            "higher": sum(d > 0 for d in diffs),
        }
    return out


def table(results: dict[str, list[dict]], base: str) -> str:
    head = f"{'variant':<14} " + " ".join(f"{c[:13]:>13}" for c in COLS) + f" {'accepted - ' + base + ' (paired)':>30}"
    lines = [head, "-" * len(head)]
    acc = paired(results, base, "accepted")
    for v, runs in results.items():
        nums = " ".join(f"{sum(r[c] for r in runs):>13.0f}" for c in COLS)
        a = acc[v]
        diff = f"{a['mean_diff']:+.1f} ± {a['se']:.1f} a set ({a['lower']} lower, {a['higher']} higher)"
        lines.append(f"{v:<14} {nums} {diff:>30}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", default=str(DEFAULT_INPUTS), help="benchmarks.gate_prompts' file")
    ap.add_argument("--targets", default=str(DEFAULT_TARGETS), help="the target's samples (cache, git-ignored)")
    ap.add_argument("--variants", default="base,off", help=f"of {', '.join(VARIANTS)}; the first is the reference")
    ap.add_argument("--seeds", type=int, default=SEEDS, help="sample sets (one closed batch of the cell each)")
    ap.add_argument("--out", default="", help="JSON to write")
    args = ap.parse_args(argv)
    names = variant_names(ap, args.variants)
    if args.seeds < 2:
        ap.error(f"--seeds: {args.seeds}; at least 2 (the paired difference needs a spread)")
    inputs = json.loads(Path(args.inputs).read_text())
    where = inputs.get("sampled", {"set": "code", "cell": "s8"})
    items = inputs["sets"][where["set"]][where["cell"]]
    sets = samples(items, args.seeds, Path(args.targets))
    results = run_variants(names, lambda options: replay(items, sets, options))
    print(table(results, names[0]))
    if args.out:
        fields = {
            "cell": f"{where['set']}/{where['cell']}",
            "temperature": SAMPLED_TEMPERATURE,
            "seeds": args.seeds,
            "runs": results,
            "accepted_paired": paired(results, names[0], "accepted"),
            "steps_paired": paired(results, names[0], "engine_steps"),
        }
        write_doc(args.out, command="benchmarks.sampled_proxy", argv=argv, names=names, fields=fields)


if __name__ == "__main__":
    main()
