"""serve_features' sampling check: the target's distribution at an output position where drafts are accepted.

Per prompt of ``sampling_prompts.json`` (token ids; the first output token near-certain, the second uncertain and
predicted by the prompt itself, so the drafter proposes it): SAMPLES completions of SAMPLE_TOKENS tokens at
temperature 1 from the no-speculation server ``ref`` (the control) and from ``spec``, with nothing else on
``spec``. The samples are grouped by their first token; a group of at least MIN_GROUP gets the exact distribution of
the second token from ``ref`` (top TOP_LOGPROBS logprobs of prompt + first token, the rest pooled). Passes when:

- ``spec``'s second tokens fit those distributions (chi-square goodness of fit, p > P_MIN), and so do ``ref``'s;
- the same test rejects ``spec``'s samples with BIAS_SHARE of them moved to each group's mode (p <= P_MIN), and its
  power against that bias, from the exact distributions and the group sizes, is at least POWER_GOAL;
- at least MIN_ACCEPTED_SHARE of ``spec``'s samples had a draft token accepted at the tested position: with
  SAMPLE_TOKENS 2 each sample has one decoding step, whose first draft position is the tested one, so vLLM's
  accepted-tokens-per-position counter at position 0 over the window counts exactly those samples.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.serve_common import http_get
from benchmarks.serve_stats import chi_square_fit, fit_power, shift_samples

SAMPLES = 12_000  # per prompt and server: power >= POWER_GOAL for the prompts' distributions (CPU-measured)
SAMPLES_PER_REQUEST = 50  # n of each request
SAMPLE_THREADS = 4  # requests in flight: their KV fits the spec server's small cache (serve_features)
SAMPLE_TOKENS = 2  # the tested position is the second output token (the first comes from prefill, never drafted)
MIN_GROUP = 500  # samples sharing a first token that make a goodness-of-fit group
TOP_LOGPROBS = 20  # vLLM's default max_logprobs
BIAS_SHARE = 0.03
POWER_GOAL = 0.99
MIN_ACCEPTED_SHARE = 0.30
P_MIN = 1e-3
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
PROMPTS_FILE = Path(__file__).with_name("sampling_prompts.json")
_POSITION = re.compile(r'position="(\d+)"')


def load_sampling_prompts(path: Path = PROMPTS_FILE) -> list[list[int]]:
    return [row["ids"] for row in json.loads(path.read_text())["prompts"]]


def accepted_per_position(url: str) -> dict[int, float]:
    """vLLM's accepted draft tokens by draft position (summed over engines) from ``url``/metrics."""
    out: dict[int, float] = defaultdict(float)
    for line in http_get(f"{url}/metrics")[1].splitlines():
        if line.startswith(PER_POS + "{"):
            pos = _POSITION.search(line)
            if pos:
                out[int(pos.group(1))] += float(line.rpartition(" ")[2])
    return out


def token_ids(choice: Any) -> list[int]:
    ids = getattr(choice, "token_ids", None)
    if ids is None:
        ids = (getattr(choice, "model_extra", None) or {}).get("token_ids")
    if ids is None:
        raise ValueError("the server returned no token_ids (vLLM's return_token_ids)")
    return list(ids)


def draw(c: Any, model: str, ids: list[int], samples: int = SAMPLES) -> list[tuple[int, int]]:
    """``samples`` (first, second) output token ids at temperature 1."""

    def one(_: int) -> list[tuple[int, int]]:
        resp = c.completions.create(
            model=model, prompt=ids, temperature=1.0, max_tokens=SAMPLE_TOKENS, n=SAMPLES_PER_REQUEST,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        pairs = [token_ids(ch) for ch in resp.choices]
        return [(p[0], p[1]) for p in pairs if len(p) == SAMPLE_TOKENS]

    with cf.ThreadPoolExecutor(SAMPLE_THREADS) as pool:
        outs = pool.map(one, range(-(-samples // SAMPLES_PER_REQUEST)))
        return [pair for o in outs for pair in o][:samples]


def exact_next(c: Any, model: str, ids: list[int]) -> dict[str, float]:
    """The target's distribution of the token after ``ids`` (top TOP_LOGPROBS), keyed by token id as a string."""
    import math

    resp = c.completions.create(
        model=model, prompt=ids, temperature=0.0, max_tokens=1, logprobs=TOP_LOGPROBS,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    top = resp.choices[0].logprobs.top_logprobs[0]
    return {name.removeprefix("token_id:"): math.exp(lp) for name, lp in top.items()}


def by_first(pairs: list[tuple[int, int]]) -> dict[int, list[str]]:
    groups: dict[int, list[str]] = defaultdict(list)
    for first, second in pairs:
        groups[first].append(str(second))
    return groups


def check_prompt(ref: Any, spec: Any, *, spec_url: str, model: str, ids: list[int]) -> dict[str, Any]:
    control = draw(ref, model, ids)
    before = accepted_per_position(spec_url)
    got = draw(spec, model, ids)
    accepted0 = accepted_per_position(spec_url).get(0, 0.0) - before.get(0, 0.0)
    groups = {f: s for f, s in by_first(got).items() if len(s) >= MIN_GROUP}
    probs = {f: exact_next(ref, model, [*ids, f]) for f in groups}
    ref_groups = by_first(control)
    _, dof, p = chi_square_fit([(groups[f], probs[f]) for f in groups])
    _, _, p_ref = chi_square_fit([(ref_groups.get(f, []), probs[f]) for f in groups])
    _, _, p_biased = chi_square_fit([(shift_samples(groups[f], share=BIAS_SHARE), probs[f]) for f in groups])
    power = fit_power([(len(groups[f]), probs[f]) for f in groups], share=BIAS_SHARE, p_min=P_MIN)
    tested = sum(map(len, groups.values()))
    share = accepted0 / len(got) if got else 0.0
    ok = bool(groups) and p > P_MIN and p_ref > P_MIN and p_biased <= P_MIN and power >= POWER_GOAL
    return {
        "ok": ok and share >= MIN_ACCEPTED_SHARE,
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


def sampling_test(ref: Any, spec: Any, *, spec_url: str, model: str, prompts: list[list[int]]) -> dict[str, Any]:
    """Every sampling prompt through ``check_prompt``; ok when each passes."""
    if not prompts:
        raise ValueError(f"no sampling prompts (make them: python -m benchmarks.sampling_prompts -> {PROMPTS_FILE})")
    per_prompt = [check_prompt(ref, spec, spec_url=spec_url, model=model, ids=ids) for ids in prompts]
    return {"ok": all(r["ok"] for r in per_prompt), "per_prompt": per_prompt}
