"""A CPU proxy of the GPU gate for the low-acceptance back-off: the gate's own prompts (``device_inputs/
gate_inputs.json``, ``benchmarks.gate_prompts``) replayed through vLLM 0.26's real ``AsyncScheduler`` and the plugin's
real proposer in schedule mode (``benchmarks.vllm_cpu_engine``: a fake runner verifies drafts, a step late, against
the target's real greedy outputs), once per variant (the default ``off``; back-off constants or the plugin's options:
calibrated chains, ...).

    python -m benchmarks.gate_proxy [--sets agentic,chat,code] [--cells b1,b8] [--variants off,calib0.06]
        [--step-model h200-8b|BASE_MS,TOKEN_US|off] [--out F]

As ``gate_worker`` runs one engine: every asked set's warm-up prompts in one batch (``WARMUP_MAX_TOKENS``), then per
set its cells in ``CELL_ORDER`` (b1: one prompt after another; bN: closed batches of N) in one long-lived engine (the
suffix drafter's global cache carries over); sampled cells are skipped. The target's outputs are the shared 53M
target's (what the GPU's inflated 8B-shaped target computes), greedy, float32, EOS respected, each prompt's
``max_tokens``: generated once with Hugging Face on the CPU and cached (git-ignored, ``--targets``), keyed by each
cell's inputs. Per cell and variant: the plugin's counters (engine steps, steps with drafts, drafted and accepted
tokens, back-offs, withheld tokens, slot schedules of a low batch), and with a step model (``--step-model``, default
an 8B step on an H200: ``benchmarks.step_model``) the plugin's clock runs on modeled GPU time, so its cost-based cut
acts, and each cell gets a modeled speed against no speculation (``model×``: the same requests' modeled walls,
stragglers included). The per-step gate's variants left with it (tag ``h41-step-gate-v2-g10``).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.bench_vllm_methods import NO_DRAFT_SUFFIX
from benchmarks.gate_compare import geomean
from benchmarks.gate_metrics import flat_numbers
from benchmarks.gate_worker import CELL_ORDER, WARMUP_MAX_TOKENS
from benchmarks.step_model import parse_step_model, plain_wall
from specdec.eval.costmodel import CostModel
from specdec.eval.results import device_label, versions
from specdec.paths import REPO_ROOT, TARGET_MODEL, model_path

DEFAULT_INPUTS = REPO_ROOT / "device_inputs" / "gate_inputs.json"
DEFAULT_TARGETS = REPO_ROOT / "device_inputs" / "gate_proxy_targets.json"
MAX_LEN = 2048  # agentic prompts (1,536 tokens) and their outputs (<= 256) with drafts past them
MAX_SEQS = 64  # the largest cell's batch
MAX_BATCHED = 16384  # vLLM's default for the LLM class on an H100/H200 (the gate's engines)
GEN_BATCH = 8  # prompts per Hugging Face generate call
EOS = 0  # the shared target's EOS id (its generation_config)
FILLER_TOKENS = 40  # past a request's end: drafts running over it are checked against EOS, as vLLM stops
# the back-off's module constants each variant sets (in-process; the engine is built after)
VARIANTS: dict[str, dict[str, Any]] = {
    "off": {},  # the default path
    # calibrated suffix chains (#42): "options" are the plugin's own (the speculative config's specdec keys)
    "calib0.02": {"options": {"drafter_options": {"suffix": {"min_confidence": 0.02}}}},
    "calib0.06": {"options": {"drafter_options": {"suffix": {"min_confidence": 0.06}}}},
    # vLLM's guard near max_model_len as it is, the patch row for it off (patches/runner.py): the near-end inputs
    "guard": {"runner.NEAR_END_ON": False},
    # a backed-off request's recovery: at an EMA of 0.5 (a shadow matching two tokens) in every batch, the default
    # until 194fc87 ("loose"); at 0.75 (three tokens) in every batch, not only in batches whose mean EMA is under
    # STRICT_BELOW as the default has it ("recover3")
    "loose": {"RECOVER_LOW_BATCH": 0.5},
    "recover3": {"RECOVER_ACCEPTED": 0.75},
    # in such a batch a recovered request backs off after 1 or 2 verified steps that accepted nothing
    "exit1": {"STRICT_EXIT_STEPS": 1},
    "exit2": {"STRICT_EXIT_STEPS": 2},
    # in such a batch recovery at five matched shadow tokens instead of four
    "recover5low": {"RECOVER_LOW_BATCH": 1.25},
    # the default before cd1369b (three matched tokens, no early exit, no step gate), and today's default without
    # its large-batch step gate
    "base": {"RECOVER_LOW_BATCH": 0.75, "STRICT_EXIT_STEPS": 0, "STEP_GATE_ON": False},
    "nogate": {"STEP_GATE_ON": False},
    # suffix drafts of depth 0 (bench_vllm_methods.NO_DRAFT_SUFFIX): the gate's specdec-nodraft server
    "nodraft": {"options": {"drafter_options": {"suffix": NO_DRAFT_SUFFIX}}},
    # batches of 8-15 rows not padded to k slots a row (policy.NARROW_FROM_ROWS 8 instead of 16): here they keep
    # per-request slots (the CPU engine runs no narrow widths); on the GPU the same constant gives them the narrow width
    "unpad8": {"policy.NARROW_FROM_ROWS": 8},
}
SETS = ("agentic", "chat", "code")  # the gate's prompt sets (warm-up cells are not measured)
VARIANT_WIDTH = 18
OPTIONS = "options"  # a variant's key holding plugin options, not module constants
CONSTANT_MODULES = {  # a variant's "module.NAME" key -> the module holding NAME (a bare NAME: the back-off's)
    "backoff": "specdec.vllm_plugin.core.backoff",
    "runner": "specdec.vllm_plugin.patches.runner",
    "policy": "specdec.vllm_plugin.core.policy",
}
COUNTERS = {  # column -> the proposer's flattened statistics key
    "steps": "steps",
    "drafted_steps": "drafted_steps",
    "drafted": "drafted_tokens",
    "accepted": "accepted_tokens",
    "back_offs": "backoff_requests_backed_off",
    "recoveries": "backoff_recoveries",
    "withheld": "backoff_withheld_tokens",
    "low_sched": "schedule.low_batch_schedules",
}
ENGINE_COUNTERS = {  # column -> the CPU engine's own count
    "engine_steps": "engine_steps",  # every scheduled step, with or without the proposer (the ratios' steps)
    "zeroed": "zeroed_steps",  # steps vLLM's guard near max_model_len ran no drafter in (their drafts zeros)
    "slot_steps": "slot_steps",  # steps with any draft slot scheduled (schedule mode; filler included)
    "slot_tokens": "slot_tokens",  # the slots: tokens verified beyond one per request
}
STEPS = "engine_steps"  # the column the ratios read
# with a step model (benchmarks.step_model): a cell's modeled walls, summed over its closed batches, in ms
MODELED = ("model_ms", "plain_ms")  # the engine's, and no speculation's for the same requests (``plain_wall``)


def cell_key(items: list[dict[str, Any]], max_tokens: list[int]) -> str:
    doc = {"model": TARGET_MODEL, "eos": EOS, "prompts": [[it["ids"], m] for it, m in zip(items, max_tokens)]}
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:24]


def load_target() -> Any:
    """The shared target in float32 on the CPU (Hugging Face)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path(TARGET_MODEL)), dtype=torch.float32).eval()


def sample(model: Any, ids: Any, *, temperature: float, max_new_tokens: int, **options: Any) -> list[list[int]]:
    """The target ``model``'s samples of ``ids`` [batch, prompt] (equal lengths, no padding) at ``temperature``, from
    its whole distribution (no top-k, no top-p): per row its new tokens. ``options``: more ``generate`` arguments."""
    import torch

    with torch.no_grad():
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            **options,
        )  # [rows, prompt + new]
    return [row[ids.shape[1] :].tolist() for row in gen]


def cached(path: Path, key: str, make: Callable[[], Any]) -> Any:
    """``make()``'s result under ``key`` in the JSON cache at ``path`` (made and written there on a miss)."""
    cache = json.loads(path.read_text()) if path.exists() else {}
    if key not in cache:
        cache[key] = make()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, separators=(",", ":")))
    return cache[key]


def generate(model: Any, prompts: list[list[int]], max_tokens: list[int], *, desc: str) -> list[list[int]]:
    """Greedy outputs of the target ``model`` (EOS respected), each at most its ``max_tokens``."""
    from tqdm import tqdm

    from benchmarks.target_outputs import greedy_outputs

    order = sorted(range(len(prompts)), key=lambda i: max_tokens[i])  # similar lengths share a generate call
    out: dict[int, list[int]] = {}
    for s in tqdm(range(0, len(order), GEN_BATCH), desc=desc, unit="batch"):
        idx = order[s : s + GEN_BATCH]
        chunk = [prompts[i] for i in idx]
        most = max(max_tokens[i] for i in idx)
        gen = greedy_outputs(model, chunk, max_tokens=most, batch=len(idx), progress=False, eos=EOS)
        for i, g in zip(idx, gen):
            out[i] = g[: max_tokens[i]]
    return [out[i] for i in range(len(prompts))]


def plan(inputs: dict[str, Any], sets: list[str], cells: list[str]) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """(set, cell, prompts with their ``max_tokens``) in the order one gate engine runs them: every set's warm-up
    in one batch (``set`` "all"), then per set its cells in ``CELL_ORDER``."""
    warm = [{**it, "max_tokens": WARMUP_MAX_TOKENS} for name in sets for it in inputs["sets"][name].get("warmup", [])]
    out = [("all", "warmup", warm)] if warm else []
    for name in sets:
        have = inputs["sets"][name]
        out += [(name, c, have[c]) for c in CELL_ORDER if c in cells and c in have and not c.startswith("s")]
    return out


def targets(steps: list[tuple[str, str, list[dict[str, Any]]]], path: Path) -> list[list[list[int]]]:
    """Each cell's outputs (per prompt), from the cache at ``path`` or generated (then cached)."""
    model: list[Any] = []  # loaded once, for the first cell the cache misses

    def make(name: str, cell: str, items: list[dict[str, Any]], mts: list[int]) -> list[list[int]]:
        if not model:
            model.append(load_target())
        return generate(model[0], [it["ids"] for it in items], mts, desc=f"target {name}/{cell}")

    out = []
    for name, cell, items in steps:
        mts = [int(it["max_tokens"]) for it in items]
        out.append(cached(path, cell_key(items, mts), functools.partial(make, name, cell, items, mts)))
    return out


@contextmanager
def variant(settings: dict[str, Any]) -> Iterator[None]:
    """The module constants ``settings`` names (but its ``OPTIONS``; ``module.NAME`` of ``CONSTANT_MODULES``, a bare
    name the back-off's) set while the block runs (restored after)."""
    import importlib

    targets = []
    for key, value in settings.items():
        if key != OPTIONS:
            module, _, name = key.rpartition(".")
            targets.append((importlib.import_module(CONSTANT_MODULES[module or "backoff"]), name, value))
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in targets]
    for mod, name, value in targets:
        setattr(mod, name, value)
    try:
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def counters(engine: Any) -> dict[str, float]:
    flat = flat_numbers(engine.proposer.stats())
    own = {col: float(getattr(engine, key)) for col, key in ENGINE_COUNTERS.items()}
    return {**{col: flat.get(key, 0.0) for col, key in COUNTERS.items()}, **own}


def target_engine(
    options: dict[str, Any] | None,
    *,
    max_len: int,
    max_seqs: int,
    max_batched: int,
    step_model: CostModel | None = None,
) -> Any:
    """A CPU engine (``vllm_cpu_engine``) in schedule mode for the shared target's config, the plugin with
    ``options``, its clock the ``step_model``'s (None: a constant per step)."""
    from benchmarks.vllm_cpu_engine import Engine

    return Engine(
        str(model_path(TARGET_MODEL)),
        schedule=True,
        max_len=max_len,
        max_seqs=max_seqs,
        max_batched=max_batched,
        options=options,
        step_model=step_model,
    )


def replay(
    steps: list[tuple[str, str, list[dict[str, Any]]]],
    outs: list[list[list[int]]],
    options: dict[str, Any] | None = None,
    *,
    max_len: int = MAX_LEN,
    step_model: CostModel | None = None,
) -> dict[str, Any]:
    """One engine (the plugin with ``options``, at ``max_len``, its clock the ``step_model``'s) through every cell:
    cell -> the plugin's counters over it (and the outputs' check), with a step model its modeled walls too."""
    from benchmarks.gate_prompts import BATCH

    engine = target_engine(options, max_len=max_len, max_seqs=MAX_SEQS, max_batched=MAX_BATCHED, step_model=step_model)
    res: dict[str, Any] = {}
    try:
        for (name, cell, items), cell_outs in zip(steps, outs):
            batch = len(items) if cell == "warmup" else BATCH[cell]
            res[f"{name}/{cell}"] = run_cell(engine, f"{name}/{cell}", items, cell_outs, batch=batch)
    finally:
        engine.close()
    return res


def run_cell(engine: Any, name: str, items: list[dict[str, Any]], outs: list[list[int]], *, batch: int) -> dict:
    """One cell through ``engine``: its prompts (``items``, each ``ids``) with their outputs ``outs`` as the target's,
    in closed batches of ``batch``; the plugin's counters over it (the outputs checked)."""
    from benchmarks.vllm_cpu_engine import Req

    before = counters(engine)
    reqs = [Req([*it["ids"], *o, *[EOS] * FILLER_TOKENS], len(it["ids"]), len(o), None) for it, o in zip(items, outs)]
    walls = [0.0, 0.0]  # modeled seconds: the engine's, no speculation's (MODELED)
    for s in range(0, len(reqs), batch):
        chunk = reqs[s : s + batch]
        t0 = engine.now
        for i, r in enumerate(chunk, start=s):
            engine.add(f"{name}/{i}", r)
        engine.run()
        if engine.step_model is not None:
            walls[0] += max(r.done_t for r in chunk) - t0
            prompts, lengths = [r.prompt for r in chunk], [r.max_tokens for r in chunk]
            walls[1] += plain_wall(prompts, lengths, engine.step_model, max_batched=MAX_BATCHED)
    after = counters(engine)
    assert all(r.ctx[r.prompt :][: r.max_tokens] == o for r, o in zip(reqs, outs)), "outputs differ"
    out = {k: after[k] - before[k] for k in after}
    if engine.step_model is not None:
        out.update({k: 1e3 * w for k, w in zip(MODELED, walls)})
    return out


def table(results: dict[str, dict[str, Any]], names: list[str]) -> str:
    """Per cell, each variant's counters and its steps / accepted against the first variant's."""
    cols = [*COUNTERS, *ENGINE_COUNTERS]
    head = (
        f"{'cell':<14} {'variant':<{VARIANT_WIDTH}} "
        + " ".join(f"{c:>9}" for c in cols)
        + f" {'steps/x':>8} {'acc/x':>7} {'model×':>7}"
    )
    lines = [head, "-" * len(head)]
    for cell in results[names[0]]:
        base = results[names[0]][cell]
        for v in names:
            row = results[v][cell]
            ratio = [row[k] / base[k] if base[k] else float("nan") for k in (STEPS, "accepted")]
            nums = " ".join(f"{row[c]:>9.0f}" for c in cols)
            speed = modeled_x(row)
            model = "-" if speed is None else f"{speed:.3f}"
            lines.append(f"{cell:<14} {v:<{VARIANT_WIDTH}} {nums} {ratio[0]:>8.3f} {ratio[1]:>7.3f} {model:>7}")
    return "\n".join(lines)


def modeled_x(row: dict[str, Any]) -> float | None:
    """A cell's modeled speed against no speculation (its output tokens over the modeled walls: the same tokens, so
    no speculation's wall over the engine's), where the run had a step model."""
    model, plain = (row.get(k) for k in MODELED)
    return plain / model if model and plain else None


def set_modeled(results: dict[str, dict[str, Any]], names: list[str]) -> dict[str, dict[str, float]]:
    """Per variant and prompt set, the geometric mean of its measured cells' modeled speed (``modeled_x``)."""
    out: dict[str, dict[str, float]] = {}
    for v in names:
        by_set: dict[str, list[float]] = {}
        for cell, row in results[v].items():
            if cell.split("/")[0] in SETS and (x := modeled_x(row)) is not None:
                by_set.setdefault(cell.split("/")[0], []).append(x)
        out[v] = {name: g for name, xs in by_set.items() if (g := geomean(xs)) is not None}
    return out


def set_steps(results: dict[str, dict[str, Any]], names: list[str]) -> dict[str, dict[str, float]]:
    """Per variant and prompt set, the geometric mean of its measured cells' engine steps over the first variant's:
    the gate's pooled view (``gate_rules.KEEP_SET_GEOMEAN_MIN``), read as steps, not speed."""
    base = results[names[0]]
    out: dict[str, dict[str, float]] = {}
    for v in names:
        by_set: dict[str, list[float]] = {}
        for cell, row in results[v].items():
            name = cell.split("/")[0]
            if name in SETS and base[cell][STEPS]:
                by_set.setdefault(name, []).append(row[STEPS] / base[cell][STEPS])
        out[v] = {name: g for name, ratios in by_set.items() if (g := geomean(ratios)) is not None}
    return out


def set_table(by_set: dict[str, dict[str, float]], title: str = "steps/x by set") -> str:
    names = list(dict.fromkeys(n for row in by_set.values() for n in row))
    head = f"{title:<{VARIANT_WIDTH}} " + " ".join(f"{n:>8}" for n in names)
    rows = [
        f"{v:<{VARIANT_WIDTH}} " + " ".join(f"{row.get(n, float('nan')):>8.3f}" for n in names)
        for v, row in by_set.items()
    ]
    return "\n".join([head, "-" * len(head), *rows])


def variant_names(ap: argparse.ArgumentParser, text: str) -> list[str]:
    """``--variants`` (comma-separated names of ``VARIANTS``); an unknown one stops the command with the valid ones."""
    names = [v for v in text.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; valid: {', '.join(VARIANTS)}")
    return names


def run_variants(names: list[str], run: Callable[[dict[str, Any] | None], dict[str, Any]]) -> dict[str, Any]:
    """``run(plugin options)`` once per variant, under the variant's module constants: variant name -> its result."""
    results = {}
    for v in names:
        with variant(VARIANTS[v]):
            results[v] = run(VARIANTS[v].get(OPTIONS))
        print(f"[{v}] done", flush=True)
    return results


def write_doc(path: str, *, command: str, argv: list[str] | None, names: list[str], fields: dict[str, Any]) -> None:
    """A proxy's results JSON: its command line, the device and versions, the variants' settings, then ``fields``."""
    doc = {
        "command": f"python -m {command} " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": device_label(),
        "versions": versions(),
        "variants": {v: VARIANTS[v] for v in names},
        **fields,
    }
    Path(path).write_text(json.dumps(doc, indent=1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", default=str(DEFAULT_INPUTS), help="benchmarks.gate_prompts' file")
    ap.add_argument("--targets", default=str(DEFAULT_TARGETS), help="the target's outputs (cache, git-ignored)")
    ap.add_argument("--sets", default="agentic,chat,code")
    ap.add_argument("--cells", default="b1,b8")
    ap.add_argument("--variants", default="off,calib0.06", help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--out", default="", help="JSON to write")
    ap.add_argument(
        "--step-model",
        default="h200-8b",
        help="the modeled GPU step (benchmarks.step_model): h200-8b, BASE_MS,TOKEN_US, or off (a constant clock)",
    )
    args = ap.parse_args(argv)
    try:
        step_model = parse_step_model(args.step_model)
    except ValueError as exc:
        ap.error(str(exc))
    names = variant_names(ap, args.variants)
    inputs = json.loads(Path(args.inputs).read_text())
    steps = plan(inputs, [s for s in args.sets.split(",") if s], [c for c in args.cells.split(",") if c])
    outs = targets(steps, Path(args.targets))
    max_len = inputs.get("max_model_len") or MAX_LEN
    results = run_variants(names, lambda options: replay(steps, outs, options, max_len=max_len, step_model=step_model))
    print(table(results, names))
    by_set = set_steps(results, names)
    print(set_table(by_set))
    modeled = set_modeled(results, names)
    if step_model is not None:
        print(set_table(modeled, "model× by set"))
    if args.out:
        fields = {"sets": args.sets, "cells": args.cells, "step_model": args.step_model, "cells_by": results}
        fields |= {"steps_by_set": by_set, "modeled_by_set": modeled}
        write_doc(args.out, command="benchmarks.gate_proxy", argv=argv, names=names, fields=fields)


if __name__ == "__main__":
    main()
