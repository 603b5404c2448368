"""``specdec-eval live``: run the target model on prompt-only sets with drafters and peers, side by side.

Per prompt, in turn (interleaved, so background load hits every method alike), each method generates up to
``--max-new-tokens`` greedily, stopping at EOS:

* ``hf-greedy``        plain ``model.generate(do_sample=False)`` (the reference output and the baseline);
* ``specdec-greedy``   ``SpecGenerator`` without a drafter (the same code path minus drafting);
* ``hf-assisted``      Hugging Face assisted generation with the draft model (``assistant_model=``);
* ``specdec <setting>`` ``SpecGenerator`` with each requested drafter (MAT, acceptance, per-position counts).

Lossless check: every method's tokens must equal the reference (``hf-greedy``, else ``specdec-greedy``) token
for token; mismatches are counted per prompt and reported with the first differing position.
Speedups are ratios of summed wall-clock seconds over the same prompts in the same run; beside them, the median
per-prompt speedup and the median seconds per prompt, and prompts slower than 3x their method's median are
flagged (one stalled prompt can dominate a sum).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from specdec.eval.live_report import BASELINES, LIVE_LEGEND, MethodRun, live_entry, live_table
from specdec.eval.settings import Setting
from specdec.paths import DRAFT_MODEL, TARGET_MODEL, model_path

if TYPE_CHECKING:
    from specdec.eval.common import Staging

logger = logging.getLogger("specdec.eval")
DEFAULT_LIVE_DRAFTERS = ("model",)
WARMUP_TOKENS = 8


def add_live_parser(sub: Any, fmt: Any, add_drafter_args: Callable, add_output_args: Callable) -> None:
    p = sub.add_parser(
        "live", formatter_class=fmt, help="run the target on prompt sets with drafters and peers", description=__doc__
    )
    p.add_argument(
        "prompts",
        nargs="+",
        metavar="SET",
        help="prompt sets: spec_bench, mt_bench, vicuna_bench, humaneval, mbpp, gsm8k, eagle_{alpaca,"
        "gsm8k,humaneval,qa,sum}, or a JSONL file with a 'prompt' per line",
    )
    g = p.add_argument_group("live run")
    g.add_argument("--data", metavar="DIR", help="shared data folder (default $SPECDEC_DATA, else ../shared/data)")
    g.add_argument(
        "--target", metavar="PATH", default=None, help=f"target model folder (default ../shared/models/{TARGET_MODEL})"
    )
    g.add_argument(
        "--draft-model",
        metavar="PATH",
        default=None,
        help=f"draft model folder for hf-assisted and the 'model' drafter's default (default "
        f"../shared/models/{DRAFT_MODEL})",
    )
    g.add_argument("--tokenizer", metavar="PATH", default=None, help="tokenizer folder (default: the target's)")
    g.add_argument("--limit", type=int, default=None, metavar="N", help="first N prompts per set (default all)")
    g.add_argument("--offset", type=int, default=0, metavar="N", help="skip the first N prompts of each set")
    g.add_argument(
        "--max-seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="time budget: start no new prompt after S seconds of generation in a set (the results "
        "then cover the prompts done, flagged stopped_early); 0 = no limit",
    )
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="new tokens per prompt (128)")
    g.add_argument(
        "--truncate-prompts",
        action="store_true",
        help="keep the last tokens of a prompt that with --max-new-tokens needs more positions than the target has "
        "(default: such a prompt is an error naming its length and the limit, as vLLM refuses it)",
    )
    g.add_argument("--no-eos", action="store_true", help="do not stop at EOS (default: stop at the EOS token)")
    g.add_argument(
        "--no-bos",
        action="store_true",
        help="do not start prompts with the tokenizer's BOS token (default: prepend it unless the "
        "tokenizer or chat template already does)",
    )
    g.add_argument(
        "--device", default="cpu", help="torch device: cpu (default), cuda, cuda:N (checked against this torch)"
    )
    g.add_argument("--threads", type=int, default=0, metavar="N", help="torch CPU threads (0 = torch default)")
    g.add_argument(
        "--baselines",
        default=",".join(BASELINES),
        metavar="LIST",
        help=f"comma-separated peers to run beside the drafters: {', '.join(BASELINES)} (default "
        "all; empty string = none)",
    )
    add_drafter_args(p, DEFAULT_LIVE_DRAFTERS)
    add_output_args(p)


class Live:
    """Loaded models and the generation methods."""

    def __init__(self, args: argparse.Namespace, tok: Any) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.no_progress:
            hf_logging.disable_progress_bar()  # transformers' "Loading weights" bars
        self.args = args
        self.target_path = args.target or str(model_path(TARGET_MODEL))
        self.draft_path = args.draft_model or str(model_path(DRAFT_MODEL))
        for what, p in (("--target", self.target_path), ("--draft-model", self.draft_path)):
            if not os.path.isdir(p):
                raise FileNotFoundError(f"{what} {p}: no such model folder; pass a local Hugging Face model folder")
        self.tok = tok
        load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).to(args.device).eval()  # noqa: E731
        self.target = load(self.target_path)
        self.draft = load(self.draft_path) if "hf-assisted" in self.baselines() else None
        if self.draft is not None:  # transformers' own assisted generation passes both to the draft model's generate
            logging.getLogger("transformers.generation.utils").addFilter(_quiet_assisted_notice)
        eos = self.target.generation_config.eos_token_id
        self.eos = None if args.no_eos else (eos[0] if isinstance(eos, (list, tuple)) else eos)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos

    def baselines(self) -> list[str]:
        return [b.strip() for b in self.args.baselines.split(",") if b.strip()]

    def hf(self, ids: list[int], n: int, assisted: bool) -> list[int]:
        import torch

        x = torch.tensor([ids], device=self.args.device)
        kw: dict[str, Any] = dict(
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
            attention_mask=torch.ones_like(x),
        )
        if self.eos is None:
            kw["eos_token_id"] = None
        if assisted:
            kw["assistant_model"] = self.draft
        with torch.inference_mode():
            out = self.target.generate(x, **kw)
        return out[0, len(ids) :].tolist()


def _quiet_assisted_notice(record: logging.LogRecord) -> bool:
    """False for transformers' notice that a ``generate`` call got a generation config and generation arguments: its
    assisted generation makes that call itself (not this code), once per process."""
    return not record.getMessage().startswith("Passing `generation_config` together with generation-related")


def _generator(live: Live, drafter: Any, setting: Setting | None) -> Any:
    from specdec.generation import SpecGenerator

    budget = setting.budget if setting else 0
    tree = setting.tree if setting else False
    return SpecGenerator(
        live.target, drafter, budget=budget, tree=tree, strict=live.args.strict, device=live.args.device
    )


def _methods(live: Live, settings: list[Setting]) -> list[tuple[MethodRun, Callable[[list[int], int], Any]]]:
    """(run record, fn(ids, n) -> (tokens, SpecStats | None)) per method, baselines first."""
    from specdec.drafters.registry import build_drafter

    out: list[tuple[MethodRun, Callable]] = []
    for b in live.baselines():
        if b not in BASELINES:
            raise ValueError(f"--baselines: unknown peer {b!r}; expected a comma-separated subset of {BASELINES}")
        if b == "specdec-greedy":
            gen = _generator(live, None, None)
            fn = (lambda g: lambda ids, n: _spec(g, ids, n, live.eos))(gen)
        else:
            fn = (lambda a: lambda ids, n: (live.hf(ids, n, a), None))(b == "hf-assisted")
        out.append((MethodRun(b), fn))
    for s in settings:
        opts = {k: dict(v) for k, v in s.options.items()}
        if "model" in s.names:
            opts.setdefault("model", {}).setdefault("path", live.draft_path)
        drafter = build_drafter(s.spec, opts)
        gen = _generator(live, drafter, s)
        out.append((MethodRun(f"specdec {s.label}", s), (lambda g: lambda ids, n: _spec(g, ids, n, live.eos))(gen)))
    return out


def _spec(gen: Any, ids: list[int], n: int, eos: int | None) -> tuple[list[int], Any]:
    res = gen.generate([ids], max_new_tokens=n, eos_token_id=eos)
    return res.tokens[0], res.stats


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def render_sets(args: argparse.Namespace, sets: list[tuple[str, list]]) -> tuple[Any, list[tuple[str, list, list]]]:
    """The tokenizer and every set's prompts as token ids, each with ``--max-new-tokens`` within the target's positions
    (its config.json's; with ``--truncate-prompts`` a longer one keeps its last tokens), before any model is loaded;
    a ``ConfigError`` naming the prompt, its length and the limit otherwise."""
    from transformers import AutoConfig, AutoTokenizer

    from specdec.eval.prompts import render_prompt
    from specdec.inputs import fit_positions, model_positions

    target = args.target or str(model_path(TARGET_MODEL))
    tok = AutoTokenizer.from_pretrained(args.tokenizer or target)
    positions = model_positions(SimpleNamespace(config=AutoConfig.from_pretrained(target)))
    out = []
    for name, items in sets:
        prompts = [render_prompt(it, tok, bos=not args.no_bos) for it in items]
        prompts = fit_positions(
            prompts,
            positions=positions,
            max_new_tokens=args.max_new_tokens,
            truncate=args.truncate_prompts,
            names=[f"prompt {it.id} of set {name!r}" for it in items],
            flags=("--truncate-prompts", "--max-new-tokens "),
        )
        out.append((name, items, prompts))
    return tok, out


def _run_set(live: Live, name: str, items: list, prompts: list[list[int]], methods: list) -> list[MethodRun]:
    from tqdm import tqdm

    n = live.args.max_new_tokens
    for _, fn in methods:  # warm-up: first-call overheads (allocations, kernels) off the clock
        fn(prompts[0], WARMUP_TOKENS)
    runs = [m for m, _ in methods]
    t_start = time.perf_counter()
    for it, ids in tqdm(
        list(zip(items, prompts)), desc=f"live {name}", unit="prompt", disable=live.args.no_progress, leave=False
    ):
        if live.args.max_seconds and time.perf_counter() - t_start > live.args.max_seconds:
            logger.warning(
                "live %s: --max-seconds %.0f reached after %d of %d prompts; stopping early",
                name,
                live.args.max_seconds,
                len(runs[0].per_prompt),
                len(items),
            )
            break
        ref = None
        for run, fn in methods:
            t0 = time.perf_counter()
            toks, stats = fn(ids, n)
            dt = time.perf_counter() - t0
            ref = toks if ref is None else ref
            diff = _first_diff(toks, ref)
            run.seconds += dt
            run.tokens += len(toks)
            if stats is not None:
                run.add_stats(stats)
            run.per_prompt.append(
                {
                    "id": it.id,
                    "prompt_tokens": len(ids),
                    "new_tokens": len(toks),
                    "seconds": dt,
                    "equal_to_reference": diff < 0,
                    "first_diff": diff,
                }
            )
    return runs


def run_live(args: argparse.Namespace) -> int:
    from specdec.eval.checks import check_live_models
    from specdec.eval.common import Staging, echo, safe_name, settings_from_args
    from specdec.eval.flags import check_flags
    from specdec.eval.results import results_path

    if args.drafter is None and not args.config:
        args.drafter = list(DEFAULT_LIVE_DRAFTERS)
    check_flags(args)
    settings = settings_from_args(args)
    sets = _load_sets(args)
    check_live_models(args, settings)
    tok, rendered = render_sets(args, sets)
    saved = results_path(safe_name(args.save_results), device=args.device) if args.save_results else None
    staging = Staging(args.out, files=[("--json", args.json), ("--save-results", saved and str(saved))])
    try:
        live = Live(args, tok)
        methods = _methods(live, settings)
        entries = _run_sets(live, methods, rendered)
        _write_results(live, staging, settings=settings, entries=entries, saved=saved)
        written = staging.commit()
    except BaseException:
        staging.abort()
        raise
    for p in written:
        echo(args, f"wrote {p}")
    return 0


def _load_sets(args: argparse.Namespace) -> list[tuple[str, list]]:
    """Every prompt set, cut to ``--offset`` / ``--limit``; a ValueError for a set the offset leaves empty."""
    from specdec.eval.prompts import load_prompts

    sets = []
    for src in args.prompts:
        name, items = load_prompts(src, limit=(args.offset + args.limit) if args.limit else None, data=args.data)
        if not items[args.offset :]:
            raise ValueError(f"prompt set {name!r}: --offset {args.offset} leaves no prompts ({len(items)} loaded)")
        sets.append((name, items[args.offset :]))
    return sets


def _run_sets(live: Live, methods: list, sets: list[tuple[str, list, list[list[int]]]]) -> list[dict[str, Any]]:
    """Every set in turn, its table echoed as it ends: the entries of every method and set."""
    from specdec.eval.checks import slow_prompt_notes
    from specdec.eval.common import echo
    from specdec.eval.report import legend, wrap

    args = live.args
    entries: list[dict[str, Any]] = []
    for name, items, prompts in sets:
        runs = _run_set(live, name, items, prompts, methods)
        ds_entries = [live_entry(name, r, runs) for r in runs]
        for e in ds_entries:
            e["prompts_requested"] = len(items)
            e["stopped_early"] = e["prompts"] < len(items)
        echo(args, "\n".join([live_table(ds_entries), *map(wrap, slow_prompt_notes(ds_entries))]) + "\n")
        entries += ds_entries
        for r in runs:  # fresh totals per set
            r.seconds, r.tokens, r.per_prompt, r.stats = 0.0, 0, [], {}
    echo(args, legend(LIVE_LEGEND))
    return entries


def _write_results(
    live: Live, staging: Staging, *, settings: list[Setting], entries: list[dict[str, Any]], saved: Path | None
) -> None:
    """The results document (``--json``, ``--save-results``) and, unless ``--no-plots``, the plots, all staged."""
    from specdec.eval.results import atomic_write_text, build_document

    args = live.args
    doc = build_document(
        {
            "command": "live",
            "args": vars(args),
            "target": live.target_path,
            "draft_model": live.draft_path,
            "eos_token_id": live.eos,
            "drafter_settings": [s.describe() for s in settings],
        },
        entries,
        device=args.device,
    )
    text = json.dumps(doc, indent=1) + "\n"
    atomic_write_text(staging.path("results.json", args.json), text)
    if args.save_results:
        atomic_write_text(staging.path("saved.json", saved), text)
    spec = [e for e in entries if e.get("mat") is not None]
    if spec and not args.no_plots:
        from specdec.eval.report import plot_mat, plot_per_position

        plot_per_position(
            spec,
            staging.path("per_position_acceptance.png"),
            title="Per-position acceptance (live generation on the target, greedy verification)",
        )
        plot_mat(
            entries,
            staging.path("speedup.png"),
            key="speedup_vs_hf_greedy",
            ylabel="wall-clock speedup vs hf-greedy (x)",
        )
