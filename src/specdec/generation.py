"""Library generation: a Hugging Face target + any drafter, verified by the reference tree verifier.

    import specdec
    result = specdec.generate(model, ["def add(a, b):"], tokenizer=tok, drafter="suffix",
                              max_new_tokens=64)
    result.tokens, result.texts, result.stats.mat

``drafter=None`` is plain (greedy or sampled) decoding through the same code path: the baseline.
Terms (accepted / recovered / bonus tokens, MAT, acceptance rate): ``specdec.verifiers.reference``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from specdec.config import ConfigBase, ConfigError, load_yaml, rng
from specdec.device import check_device
from specdec.drafters.base import Drafter, DraftGuard, DraftRequest
from specdec.inputs import (
    as_prompt_list,
    check_call,
    default_eos,
    encode_prompts,
    fit_positions,
    model_positions,
    prompt_ids,
)
from specdec.sampling import SamplingParams
from specdec.stats import AcceptanceCounts
from specdec.tree import TokenTree
from specdec.verifiers.reference import ReferenceVerifier, StepOutcome, vocab_ok

logger = logging.getLogger("specdec.generation")

MAX_BUDGET = 1024  # draft tokens per request per step; more only wastes the verifier's forward pass


@dataclass(frozen=True)
class GenerateConfig(ConfigBase):
    """Generation settings (YAML preset: ``configs/generate.yaml``)."""

    budget: int = rng(8, lo=0, hi=MAX_BUDGET, doc="max draft tokens (tree nodes) per request per step")
    tree: bool = rng(False, doc="ask drafters for trees (True) or chains (False)")
    temperature: float = rng(0.0, lo=0.0, hi=100.0, doc="0 = greedy; > 0 samples losslessly")
    top_p: float = rng(1.0, lo=1e-6, hi=1.0, doc="nucleus mass kept before sampling (1 = off)")
    top_k: int = rng(0, lo=0, hi=1_000_000, doc="tokens kept before sampling (0 = off)")
    seed: int | None = rng(None, lo=0, doc="sampling seed (None = random)")
    strict: bool = rng(False, doc="re-raise drafter errors instead of drafting nothing for that step")
    max_new_tokens: int = rng(128, lo=0, hi=1_000_000, doc="new tokens per prompt at most")
    eos_token_id: int | None = rng(None, lo=0, doc="stop token (None = never stop early)")
    device: str | None = rng(None, doc="torch device for a target given as a path (None = cuda if available)")

    def validate(self, *, where: str = "") -> None:
        super().validate(where=where)
        if self.device is not None:
            check_device(self.device, key=f"{where}device")

    @classmethod
    def from_yaml(cls, name_or_path: str | os.PathLike[str] = "generate") -> GenerateConfig:
        return cls.from_dict(load_yaml(name_or_path), where=f"config {str(name_or_path)!r}: ")


@dataclass
class SpecStats(AcceptanceCounts):
    """Counters of one ``generate`` call (terms: ``specdec.verifiers.reference``; counters: ``specdec.stats``).

    Steps are request-steps. ``accepted_tokens`` counts the verifier's acceptances; ``emitted_tokens`` what
    was returned (after cutting at EOS / ``max_new_tokens``).
    """

    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    wall_seconds: float = 0.0
    draft_errors: int = 0
    draft_timeouts: int = 0
    forward_passes: int = 0

    def record(self, tree: TokenTree, outcome: StepOutcome, emitted: int) -> None:
        self.observe(drafted=len(tree), depth=tree.max_depth, accepted=outcome.num_accepted, emitted=emitted)

    def merge(self, other: SpecStats) -> SpecStats:
        """Sum of two calls' counters (e.g. prompts run in several batches)."""
        out = SpecStats()
        for f in fields(SpecStats):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, list):
                n = max(len(a), len(b))
                setattr(out, f.name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])
            else:
                setattr(out, f.name, a + b)
        return out

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mat": self.mat, "acceptance_rate": self.acceptance_rate}


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per prompt, EOS included if produced
    stats: SpecStats
    texts: list[str] | None = None  # decoded ``tokens`` when a tokenizer was given


def load_target(target: Any, *, device: str | None = None) -> torch.nn.Module:
    """A HF causal LM as given, or loaded (float32) from a folder path; moved to ``device`` if set."""
    if isinstance(target, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        if not os.path.isdir(target):
            raise FileNotFoundError(f"target={str(target)!r} is not a model folder; pass a HF model or its folder")
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(dev).eval()
    if not isinstance(target, torch.nn.Module):
        raise TypeError(f"target must be a Hugging Face causal LM or a folder path, got {type(target).__name__}")
    return target.to(device).eval() if device else target.eval()


class SpecGenerator:
    """Speculative generation with one drafter (or none) and the reference verifier."""

    def __init__(
        self,
        target: Any,
        drafter: Drafter | None = None,
        *,
        budget: int = 8,
        tree: bool = False,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        strict: bool = False,
        device: str | None = None,
    ) -> None:
        self.config = GenerateConfig.from_dict(
            dict(
                budget=budget,
                tree=tree,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                strict=strict,
                device=device,
            )
        )
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a specdec Drafter or None, got {type(drafter).__name__}")
        self.model = load_target(target, device=device)
        self.drafter = drafter
        if drafter is not None:  # a draft model of another vocabulary is refused here, not after a run of MAT 1.0
            name = str(getattr(self.model, "name_or_path", "") or "")
            drafter.check_target(
                vocab_size=int(self.model.get_input_embeddings().num_embeddings),
                tokenizer_dir=name if name and os.path.isdir(name) else None,
            )
        self.sampling = SamplingParams(temperature, top_p, top_k)
        self.verifier = ReferenceVerifier(self.model, sampling=self.sampling, seed=seed)
        self._calls = 0

    @classmethod
    def from_config(cls, target: Any, drafter: Drafter | None, config: GenerateConfig) -> SpecGenerator:
        keys = ("budget", "tree", "temperature", "top_p", "top_k", "seed", "strict", "device")
        return cls(target, drafter, **{k: getattr(config, k) for k in keys})

    # ------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        eos_token_id: int | None = None,
        progress: bool = False,
        truncate_prompts: bool = False,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` per prompt; stop a prompt at ``eos_token_id`` (None: never). A prompt that
        with ``max_new_tokens`` needs more positions than the target has is refused, or with ``truncate_prompts``
        keeps its last tokens (``specdec.inputs``)."""
        max_new_tokens, eos_token_id = check_call(max_new_tokens, eos_token_id, vocab_size=self.verifier.vocab_size)
        prompts = [prompt_ids(i, p) for i, p in enumerate(as_prompt_list(prompts))]
        prompts = fit_positions(
            prompts, positions=model_positions(self.model), max_new_tokens=max_new_tokens, truncate=truncate_prompts
        )
        t_start = time.perf_counter()
        self._calls += 1
        rids = [f"gen{self._calls}-{i}" for i in range(len(prompts))]
        outputs: list[list[int]] = [[] for _ in prompts]
        stats = SpecStats()
        if not prompts or max_new_tokens == 0:
            return GenerationResult(outputs, stats)
        guard = self._start(prompts, rids)
        active = list(range(len(prompts)))  # prompt index of each verifier row
        bar = _progress(progress, len(prompts) * max_new_tokens)
        try:
            while active:
                room = [max_new_tokens - len(outputs[i]) for i in active]
                trees = self._draft(guard, [rids[i] for i in active], room)
                t0 = time.perf_counter()
                outcomes = self.verifier.step(trees)
                stats.verify_seconds += time.perf_counter() - t0
                keep = []
                for row, (i, tree, outcome) in enumerate(zip(active, trees, outcomes)):
                    emitted, done = _cut(outcome.tokens, max_new_tokens - len(outputs[i]), eos_token_id)
                    outputs[i].extend(emitted)
                    stats.record(tree, outcome, len(emitted))
                    if bar is not None:  # a finished request also counts its unused room
                        bar.update(len(emitted) + (max_new_tokens - len(outputs[i]) if done else 0))
                    if guard is not None:
                        guard.call("extend", rids[i], emitted)
                    if done:
                        if guard is not None:
                            guard.call("stop", rids[i])
                    else:
                        keep.append(row)
                if len(keep) < len(active):
                    active = [active[r] for r in keep]
                    self.verifier.select(keep)
        finally:
            if bar is not None:
                bar.close()
            if guard is not None:
                for i in active:  # aborted by an exception: free the drafter's state
                    guard.call("stop", rids[i])
        self._finish_stats(stats, guard, t_start)
        return GenerationResult(outputs, stats)

    def _start(self, prompts: Sequence[Sequence[int]], rids: list[str]) -> DraftGuard | None:
        """Reset the verifier to ``prompts`` and start each request on the drafter, through a guard (None: no
        drafter)."""
        guard = DraftGuard(self.drafter, strict=self.config.strict) if self.drafter is not None else None
        self.verifier.reset(prompts)
        if guard is not None:
            for rid, prompt in zip(rids, prompts):
                guard.call("start", rid, list(prompt))
        return guard

    def _finish_stats(self, stats: SpecStats, guard: DraftGuard | None, t_start: float) -> None:
        """A finished call's totals into ``stats``: the verifier's forward passes (its count restarts), the drafter's
        time, errors and timeouts, the wall time since ``t_start``."""
        stats.forward_passes = self.verifier.forward_passes
        self.verifier.forward_passes = 0
        if guard is not None:
            stats.draft_seconds = guard.stats.draft_seconds
            stats.draft_errors = guard.stats.errors
            stats.draft_timeouts = guard.stats.timeouts
        stats.wall_seconds = time.perf_counter() - t_start

    def _draft(self, guard: DraftGuard | None, rids: list[str], remaining: list[int]) -> list[TokenTree]:
        """One tree per active request; budgets shrink near ``max_new_tokens`` (no draft past it)."""
        trees = [TokenTree.empty() for _ in rids]
        if guard is None or self.config.budget == 0:
            return trees
        wanted = [
            (k, DraftRequest(rid, min(self.config.budget, left - 1), self.config.tree))
            for k, (rid, left) in enumerate(zip(rids, remaining))
            if left > 1
        ]
        if not wanted:
            return trees
        drafted = guard.draft_batch([req for _, req in wanted])
        for (k, req), tree in zip(wanted, drafted):
            if not vocab_ok(tree, self.verifier.vocab_size):
                err = ValueError(f"{self.drafter.name} drafted token ids outside [0, {self.verifier.vocab_size})")
                if self.config.strict:
                    raise err
                guard.record_error(err, [req.request_id])
                continue
            trees[k] = tree if (req.tree or tree.is_chain()) else tree.to_chain(req.budget)
        return trees


def _cut(tokens: list[int], room: int, eos: int | None) -> tuple[list[int], bool]:
    """Emitted tokens cut to ``room`` and after the first EOS; (tokens, request finished)."""
    out = tokens[:room]
    if eos is not None and eos in out:
        return out[: out.index(eos) + 1], True
    return out, len(out) >= room


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="tok")


_GEN_KEYS = ("max_new_tokens", "eos_token_id", "progress", "truncate_prompts")


def generate(
    target: Any,
    prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
    *,
    drafter: Any = None,
    tokenizer: Any = None,
    **kw: Any,
) -> GenerationResult:
    """One-call generation. ``prompts``: token-id lists, or strings with ``tokenizer``; a single string or a
    single flat list of ids is one prompt.

    ``drafter``: a Drafter, a drafter spec for ``specdec.build_drafter`` (``"suffix"``, ``["suffix",
    "model"]``), or None (plain decoding). ``kw``: ``SpecGenerator`` options (budget, tree, temperature,
    top_p, top_k, seed, strict, device) and ``max_new_tokens`` (default 128), ``eos_token_id`` (default:
    the tokenizer's, else the model's generation config; pass None to never stop early), ``progress``,
    ``truncate_prompts`` (a prompt too long for the target's positions keeps its last tokens instead of being
    refused). Inputs that would otherwise be guessed at are refused: ``specdec.inputs``.
    """
    gen_kw = {k: kw.pop(k) for k in _GEN_KEYS if k in kw}
    unknown = sorted(set(kw) - set(GenerateConfig.__dataclass_fields__))
    if unknown:
        raise ConfigError(
            f"unknown key(s) {', '.join(map(repr, unknown))} for generate(); valid keys: "
            f"{', '.join(sorted(set(GenerateConfig.__dataclass_fields__) | set(_GEN_KEYS)))}"
        )
    ids = encode_prompts(prompts, tokenizer)
    built = drafter is not None and not isinstance(drafter, Drafter)
    if built:
        from specdec.drafters.registry import build_drafter

        drafter = build_drafter(drafter)
    try:
        gen = SpecGenerator(target, drafter, **kw)
        if "eos_token_id" not in gen_kw:
            gen_kw["eos_token_id"] = default_eos(tokenizer, gen.model)
        gen_kw.setdefault("max_new_tokens", GenerateConfig.max_new_tokens)
        result = gen.generate(ids, **gen_kw)
    finally:
        if built:  # a drafter built here is released here
            drafter.close()
    if tokenizer is not None:
        result.texts = [tokenizer.decode(t) for t in result.tokens]
    return result
