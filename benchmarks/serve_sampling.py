"""serve_features' sampling check: the target's distribution at an output position where drafts are accepted.

Per prompt of ``sampling_prompts.json`` for the mode's tested position P (TESTED_POSITION; token ids: the output
tokens before P near-certain, the one at P uncertain and predicted by the prompt itself, so the drafter proposes
it): SAMPLES completions of P tokens at temperature 1 from the no-speculation server ``ref`` (the control) and from
``spec``, with nothing else on ``spec``. The samples are grouped by their first P - 1 tokens; a group of at least
MIN_GROUP gets the exact distribution of token P from ``ref`` (top TOP_LOGPROBS logprobs of prompt + prefix, the
rest pooled). Passes when:

- ``spec``'s tokens at P fit those distributions (chi-square goodness of fit, p > P_MIN), and so do ``ref``'s;
- the same test rejects ``spec``'s samples with BIAS_SHARE of them moved to each group's mode (p <= P_MIN), and its
  power against that bias, from the exact distributions and the group sizes, is at least POWER_GOAL;
- at least MIN_ACCEPTED_SHARE of ``spec``'s samples had a draft token accepted at P (``accepted_at``, from vLLM's
  counters over the window: accepted tokens per draft position and inter-token latency observations, one per
  decoding step of a request).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.serve_common import by_label, http_get, parse_metrics
from benchmarks.serve_stats import chi_square_fit, fit_power, shift_samples

SAMPLES = 12_000  # per prompt and server: power >= POWER_GOAL for the prompts' distributions (CPU-measured)
SAMPLES_PER_REQUEST = 50  # n of each request
SAMPLE_THREADS = 4  # requests in flight: their KV fits the spec server's small cache (serve_features)
# the tested output position per async_mode (the first token comes from prefill, never drafted): in schedule mode
# the samples' first decoding steps mostly share a step with the burst's other prefills, where decoding requests get
# no draft slots (the plugin's prefill_step_slots 0 on compute-bound steps)
TESTED_POSITION = {"thread": 2, "schedule": 3}
MIN_GROUP = 500  # samples sharing a prefix (the tokens before the tested one) that make a goodness-of-fit group
TOP_LOGPROBS = 20  # vLLM's default max_logprobs
BIAS_SHARE = 0.03
POWER_GOAL = 0.99
MIN_ACCEPTED_SHARE = 0.30
P_MIN = 1e-3
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
STEPS = "vllm:inter_token_latency_seconds_count"  # one observation per decoding step of a request
PROMPTS_FILE = Path(__file__).with_name("sampling_prompts.json")


def load_sampling_prompts(position: int, path: Path = PROMPTS_FILE) -> list[list[int]]:
    """The prompts picked for ``position`` (rows without one were picked for position 2)."""
    rows = json.loads(path.read_text())["prompts"]
    return [row["ids"] for row in rows if row.get("position", 2) == position]


def window_counts(url: str) -> tuple[dict[int, float], float]:
    """(vLLM's accepted draft tokens by draft position, its decoding steps) from ``url``/metrics, summed over
    engines and label sets."""
    text = http_get(f"{url}/metrics")[1]
    per_pos = {int(pos): n for pos, n in by_label(text, PER_POS, "position").items()}
    return per_pos, parse_metrics(text).get(STEPS, 0.0)


def accepted_at(position: int, *, samples: int, accepted: dict[int, float], steps: float) -> float:
    """How many of ``samples`` completions of ``position`` tokens had a draft accepted at ``position``, at least,
    from the window's accepted tokens by draft position and its decoding steps:

    - position 2: every sample has one decoding step, starting at token 2, so each accepted position-0 draft is
      one at token 2 (exact);
    - position 3: a sample has one decoding step when that step accepted position 0 (token 2 a draft, token 3 its
      step's last) and two otherwise, so ``2 samples - steps`` first steps accepted position 0, and the rest of
      the position-0 count came from second steps, which start at token 3 (``second``, at most one per second
      step). Token 3 was a draft in those and in the first steps that also accepted position 1. The position-1
      count holds those first steps and second steps that accepted position 1 too (vLLM verifies a step's whole
      draft past max_tokens), never more than ``second``: so max(position 1, ``second``) is a lower bound."""
    if position == 2:
        return min(accepted.get(0, 0.0), samples)
    if position == 3:
        one_step = 2 * samples - steps
        second = max(0.0, min(accepted.get(0, 0.0) - one_step, steps - samples))
        return min(max(accepted.get(1, 0.0), second), samples)
    raise ValueError(f"tested position {position}: only 2 and 3 are counted (TESTED_POSITION)")


def token_ids(choice: Any) -> list[int]:
    ids = getattr(choice, "token_ids", None)
    if ids is None:
        ids = (getattr(choice, "model_extra", None) or {}).get("token_ids")
    if ids is None:
        raise ValueError("the server returned no token_ids (vLLM's return_token_ids)")
    return list(ids)


def draw(c: Any, model: str, ids: list[int], *, position: int, samples: int = SAMPLES) -> list[tuple[int, ...]]:
    """``samples`` completions of ``position`` output token ids at temperature 1."""

    def one(_: int) -> list[tuple[int, ...]]:
        resp = c.completions.create(
            model=model, prompt=ids, temperature=1.0, max_tokens=position, n=SAMPLES_PER_REQUEST,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        outs = [token_ids(ch) for ch in resp.choices]
        return [tuple(o) for o in outs if len(o) == position]

    with cf.ThreadPoolExecutor(SAMPLE_THREADS) as pool:
        outs = pool.map(one, range(-(-samples // SAMPLES_PER_REQUEST)))
        return [out for o in outs for out in o][:samples]


def exact_next(c: Any, model: str, ids: list[int]) -> dict[str, float]:
    """The target's distribution of the token after ``ids`` (top TOP_LOGPROBS), keyed by token id as a string."""
    import math

    resp = c.completions.create(
        model=model, prompt=ids, temperature=0.0, max_tokens=1, logprobs=TOP_LOGPROBS,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    top = resp.choices[0].logprobs.top_logprobs[0]
    return {name.removeprefix("token_id:"): math.exp(lp) for name, lp in top.items()}


def by_prefix(outs: list[tuple[int, ...]]) -> dict[tuple[int, ...], list[str]]:
    """The last token of each output, grouped by the tokens before it."""
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for out in outs:
        groups[out[:-1]].append(str(out[-1]))
    return groups


def check_prompt(ref: Any, spec: Any, *, spec_url: str, model: str, ids: list[int], position: int) -> dict[str, Any]:
    control = draw(ref, model, ids, position=position)
    per_pos, steps = window_counts(spec_url)
    got = draw(spec, model, ids, position=position)
    per_pos_after, steps_after = window_counts(spec_url)
    accepted = accepted_at(
        position,
        samples=len(got),
        accepted={k: v - per_pos.get(k, 0.0) for k, v in per_pos_after.items()},
        steps=steps_after - steps,
    )
    groups = {f: s for f, s in by_prefix(got).items() if len(s) >= MIN_GROUP}
    probs = {f: exact_next(ref, model, [*ids, *f]) for f in groups}
    ref_groups = by_prefix(control)
    _, dof, p = chi_square_fit([(groups[f], probs[f]) for f in groups])
    _, _, p_ref = chi_square_fit([(ref_groups.get(f, []), probs[f]) for f in groups])
    _, _, p_biased = chi_square_fit([(shift_samples(groups[f], share=BIAS_SHARE), probs[f]) for f in groups])
    power = fit_power([(len(groups[f]), probs[f]) for f in groups], share=BIAS_SHARE, p_min=P_MIN)
    tested = sum(map(len, groups.values()))
    share = accepted / len(got) if got else 0.0
    ok = bool(groups) and p > P_MIN and p_ref > P_MIN and p_biased <= P_MIN and power >= POWER_GOAL
    return {
        "ok": ok and share >= MIN_ACCEPTED_SHARE,
        "position": position,
        "samples": [len(control), len(got)],
        "tested": tested,
        "groups": len(groups),
        "dof": dof,
        "p": p,
        "p_control": p_ref,
        "p_biased": p_biased,
        "power": power,
        "accepted_share": share,
    }


def sampling_test(
    ref: Any, spec: Any, *, spec_url: str, model: str, prompts: list[list[int]], position: int
) -> dict[str, Any]:
    """Every sampling prompt of ``position`` through ``check_prompt``; ok when each passes."""
    if not prompts:
        raise ValueError(
            f"no sampling prompts for position {position} "
            f"(make them: python -m benchmarks.sampling_prompts -> {PROMPTS_FILE})"
        )
    per_prompt = [
        check_prompt(ref, spec, spec_url=spec_url, model=model, ids=ids, position=position) for ids in prompts
    ]
    return {"ok": all(r["ok"] for r in per_prompt), "per_prompt": per_prompt}
