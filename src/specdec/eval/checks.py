"""Up-front checks of ``specdec-eval`` runs and the notes printed beside their results.

* ``check_draft_model_tokenizer``: a ``model`` drafter drafts in its own vocabulary, so the traces it replays
  must be tokenized with the same tokenizer (else every draft is rejected: MAT 1.0, silently). Checked before
  any trace is loaded.
* ``cpu_notes``: one line per result whose drafting CPU time per step exceeds the modelled verification time
  (the projected speedup is then bound by the CPU, not by acceptance), saying why.
* ``slow_prompt_notes``: live runs whose summed seconds are dominated by a few stalled prompts.
* ``check_live_models``: ``live``'s target, tokenizer and draft model folders exist and the draft models share the
  target's tokenizer, before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specdec.config import ConfigError
from specdec.eval.settings import Setting

MODEL_DRAFTER = "model"
SLOW_PROMPT_FACTOR = 3.0  # a live prompt slower than this many times its method's median is flagged

BASELINES = ("hf-greedy", "specdec-greedy", "hf-assisted")  # the peers live measures beside specdec (--baselines)


def _draft_model_path(setting: Setting, default: str | os.PathLike[str] | None = None) -> Path:
    from specdec.drafters.model import ModelDrafterConfig

    own = setting.options.get(MODEL_DRAFTER, {})
    cfg = ModelDrafterConfig.from_dict({"path": str(own.get("path") or default or "")})
    return cfg.resolved_path()


def check_draft_model_tokenizer(settings: Sequence[Setting], tokenizer: Any) -> None:
    """Raise ConfigError when a setting's draft model does not share the traces' tokenizer (``tokenizer``: the
    ``--tokenizer`` value; ``none`` skips the check: token-id traces of an unknown vocabulary)."""
    from specdec.eval.tokenization import ByteTokenizer, HFTokenizer, load_tokenizer

    paths = {_draft_model_path(s) for s in settings if MODEL_DRAFTER in s.names}
    if not paths:
        return
    tok = load_tokenizer(tokenizer)
    for path in sorted(paths):
        if not (path / "config.json").exists():
            raise ConfigError(
                f"drafter 'model': path={str(path)!r} is not a Hugging Face model folder (no "
                "config.json); set --option model.path=<draft model folder>"
            )
        if isinstance(tok, ByteTokenizer):
            raise ConfigError(
                f"drafter 'model' ({path}) drafts in its own vocabulary, but the traces are "
                "tokenized as UTF-8 bytes: pass --tokenizer <the draft or target model folder>"
            )
        if isinstance(tok, HFTokenizer):
            _check_pair(path, tok.path)


def _check_pair(draft: Path, tokenizer_dir: Path) -> None:
    from specdec.drafters.model import check_tokenizer_compat

    try:
        check_tokenizer_compat(draft, tokenizer_dir)
    except ConfigError as exc:
        raise ConfigError(f"drafter 'model': {exc} (the traces use --tokenizer {tokenizer_dir})") from None


def cpu_notes(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """A line per result whose CPU time per step (drafting + update) exceeds the modelled verify time."""
    from specdec.eval.results import cpu_count

    notes = []
    for r in results:
        cpu, verify = float(r.get("cpu_ms_per_step", 0.0)), float(r.get("verify_ms_per_step", 0.0))
        if not verify or cpu <= verify:
            continue
        names = r.get("names") or [r.get("drafter", "?")]
        why = (
            f"the draft model's forward passes on {cpu_count()} CPU core(s) of this machine"
            if MODEL_DRAFTER in names
            else f"the drafter's CPU work on {cpu_count()} CPU core(s) of this machine"
        )
        notes.append(
            f"note: {r.get('dataset', '?')} / {r.get('label', r.get('drafter', '?'))}: drafting takes "
            f"{cpu:.2f} ms per step, more than the modelled verification ({verify:.2f} ms per step), so the "
            f"projected speedup ({float(r.get('projected_speedup', 0.0)):.2f}x) is bound by {why}, not by "
            "acceptance; more or faster cores, or --verify-ms for a slower target, change it"
        )
    return notes


def slow_prompt_notes(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """A line per live method with prompts slower than ``SLOW_PROMPT_FACTOR`` x its median prompt."""
    notes = []
    for e in entries:
        slow = e.get("slow_prompts") or []
        if slow:
            shown = ", ".join(f"{p['id']} ({p['seconds']:.2f} s)" for p in slow[:5])
            notes.append(
                f"warning: {e.get('dataset', '?')} / {e['method']}: {len(slow)} prompt(s) took more than "
                f"{SLOW_PROMPT_FACTOR:g}x the median {e['median_seconds']:.2f} s: {shown}; the summed "
                "speedups are skewed by them, compare the median columns"
            )
    return notes


def per_prompt_medians(seconds: Sequence[float], peers: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Median seconds per prompt, median per-prompt speedup against each peer (same prompts, same order), and
    the prompts slower than ``SLOW_PROMPT_FACTOR`` x the median (indices)."""
    if not seconds:
        return {"median_seconds": 0.0, "slow_indices": []}
    med = statistics.median(seconds)
    out: dict[str, Any] = {
        "median_seconds": med,
        "slow_indices": [i for i, s in enumerate(seconds) if med > 0 and s > SLOW_PROMPT_FACTOR * med],
    }
    for peer, theirs in peers.items():
        ratios = [b / a for a, b in zip(seconds, theirs) if a > 0]
        if ratios and len(theirs) == len(seconds):
            out[f"median_speedup_vs_{peer.replace('-', '_')}"] = statistics.median(ratios)
    return out


def check_live_models(args: argparse.Namespace, settings: list[Setting]) -> None:
    """Before any model is loaded: ``--baselines`` names known peers, the folders exist, every draft model
    (hf-assisted's, each ``model`` drafter's) shares the target's tokenizer and vocabulary."""
    from specdec.drafters.model import check_draft_target
    from specdec.paths import DRAFT_MODEL, TARGET_MODEL, model_path

    unknown = [b.strip() for b in args.baselines.split(",") if b.strip() and b.strip() not in BASELINES]
    if unknown:
        raise ConfigError(
            f"--baselines: unknown peer {unknown[0]!r}; expected a comma-separated subset of {', '.join(BASELINES)} "
            "(or '' for none)"
        )
    target = args.target or str(model_path(TARGET_MODEL))
    draft = args.draft_model or str(model_path(DRAFT_MODEL))
    drafts = {draft} if "hf-assisted" in [b.strip() for b in args.baselines.split(",")] else set()
    drafts |= {str(s.options.get(MODEL_DRAFTER, {}).get("path") or draft) for s in settings if MODEL_DRAFTER in s.names}
    if not os.path.isdir(target):
        raise FileNotFoundError(f"--target {target}: no such model folder; pass a local Hugging Face model folder")
    if args.tokenizer is not None and not os.path.isdir(args.tokenizer):
        raise FileNotFoundError(
            f"--tokenizer {args.tokenizer}: no such folder; live tokenizes prompts for the target: pass a local "
            "Hugging Face tokenizer folder, or omit --tokenizer for the target's own"
        )
    for d in sorted(drafts):
        if not os.path.isdir(d):
            raise FileNotFoundError(f"--draft-model {d}: no such model folder; pass a local Hugging Face model folder")
        check_draft_target(d, target_dir=target)
