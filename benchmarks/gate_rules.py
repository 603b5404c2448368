"""The GPU gate's verdict rules (issue 41), one function per rule, each with its named constants.

* vs no speculation: a cell at >= ``NOSPEC_PASS`` x passes; a cell under it is re-run once in the same engine and
  passes if the mean of the two ratios is >= ``RERUN_MEAN_PASS``, else fails. The re-run repeats the cell's prompts,
  whose outputs the drafter's global cache then holds: it counts only if the engine took about as many steps for it
  as for the first run (``RERUN_STEPS_MIN`` of them); fewer steps say the cache, not the run's noise, made it faster.
* vs vLLM ``suffix``: >= ``SUFFIX_PASS`` x PASS, ``SUFFIX_WARN``-``SUFFIX_PASS`` x WARN, under ``SUFFIX_WARN`` x FAIL.
* engine start <= ``START_MAX`` x no speculation's; KV-cache tokens >= ``KV_MIN`` of no speculation's.
* low-acceptance serving: median TPOT <= ``TPOT_MAX`` x no speculation's.
* the run is VOID when no speculation's two repeats of a cell differ by more than ``REPEAT_MAX_DIFF``.
* same work (``gate_compare``'s noise floor): on a greedy cell both engines returned the same outputs with drafted
  and accepted tokens within ``SAME_WORK_TOL``; their ratio is the run's noise between the two engines, not the change.
* before/after (``gate_compare``): a cell counts when both engines' outputs repeat like no speculation's (their
  shares of repeated 4-grams within ``REP4_SHIFT_MAX`` of its). KEEP when the change loses nothing beyond the
  noise (at every TP the counted cells' geometric mean of candidate over before >= ``KEEP_GEOMEAN_MIN``, each
  prompt set's >= ``KEEP_SET_GEOMEAN_MIN``, no cell under ``KEEP_CELL_FLOOR``; the serve check's TPOT ratio at most
  before's + ``KEEP_SERVE_SLACK``) and wins something (a
  TP's geometric mean >= ``WIN_GEOMEAN``, or the serve TPOT ratio at least ``WIN_SERVE`` under before's); else DROP.

Every boundary is inclusive on the passing side; ``EPS`` keeps a ratio that is the boundary up to float rounding
(0.98 and 1.00 average to 0.99) on that side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

PASS, WARN, FAIL, VOID = "PASS", "WARN", "FAIL", "VOID"
NONE = "-"  # no verdict (a reference is missing)
NOSPEC_PASS = 1.0
RERUN_MEAN_PASS = 0.99
RERUN_STEPS_MIN = 0.9  # a re-run taking fewer engine steps than this share of the first run's does not count
SUFFIX_PASS = 1.5
SUFFIX_WARN = 1.3
START_MAX = 1.25
KV_MIN = 0.97
TPOT_MAX = 1.03
REPEAT_MAX_DIFF = 0.02
REP4_SHIFT_MAX = 0.05  # an engine's share of repeated 4-grams may differ from no speculation's by this much
# before/after noise: two engines of one policy differ cell by cell by more than a real change's size (bf16 outputs
# that part ways, a closed batch's one slow request), so no single cell decides; a set's four greedy cells pool it,
# a TP's geometric mean more (the measured spread: docs/results.md, benchmarks.gate_noise)
KEEP_GEOMEAN_MIN = 0.98  # the counted cells' geometric mean, candidate / before, at every TP (no loss past noise)
KEEP_SET_GEOMEAN_MIN = 0.95  # ... each prompt set's counted cells' geometric mean at every TP
KEEP_CELL_FLOOR = 0.8  # ... and no counted cell under this
KEEP_SERVE_SLACK = 0.01  # the candidate's serve TPOT ratio may exceed before's by this much (a call's own noise)
WIN_GEOMEAN = 1.02  # a win: a TP's geometric mean at least this
WIN_SERVE = 0.01  # ... or the serve TPOT ratio at least this much under before's
# two engines did the same work on a greedy cell when their outputs are identical and their drafted and accepted
# tokens (vLLM's counters) within this share of each other: their ratio is the run's noise between the engines
SAME_WORK_TOL = 0.03
EPS = 1e-9
SEVERITY = {NONE: 0, PASS: 1, WARN: 2, FAIL: 3, VOID: 4}  # the overall verdict is the most severe one


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, None when either is missing or ``den`` is not positive."""
    if num is None or den is None or den <= 0:
        return None
    return num / den


def repeat_diff(a: float, b: float) -> float:
    """Relative difference of two repeats: |a - b| over their mean (0 when both are 0)."""
    mean = (a + b) / 2
    return abs(a - b) / mean if mean > 0 else 0.0


def repeats_void(a: float, b: float) -> bool:
    """True when no speculation's two repeats of a cell differ by more than ``REPEAT_MAX_DIFF``."""
    return repeat_diff(a, b) > REPEAT_MAX_DIFF + EPS


def vs_nospec(
    first: float | None, rerun: float | None = None, steps: tuple[float, float] | None = None
) -> tuple[str, str]:
    """(verdict, note) of a cell's ratio to no speculation, given its re-run's ratio where it was re-run and the
    engine steps of (first run, re-run) where the plugin counted them."""
    if first is None:
        return NONE, "no reference"
    if first >= NOSPEC_PASS - EPS:
        return PASS, ""
    if rerun is None:
        return FAIL, "not re-run"
    if not rerun_counts(steps):
        return FAIL, f"re-run in {steps[1]:.0f} steps against {steps[0]:.0f}: helped by the cache, not counted"
    mean = (first + rerun) / 2
    verdict = PASS if mean >= RERUN_MEAN_PASS - EPS else FAIL
    return verdict, f"re-run mean {mean:.3f}"


def rerun_counts(steps: tuple[float, float] | None) -> bool:
    """A re-run counts unless it took fewer than ``RERUN_STEPS_MIN`` of the first run's engine steps (unknown: it
    counts)."""
    if not steps or not steps[0]:
        return True
    return steps[1] >= RERUN_STEPS_MIN * steps[0] - EPS


def vs_suffix(r: float | None) -> str:
    """Verdict of a cell's ratio to vLLM suffix."""
    if r is None:
        return NONE
    if r >= SUFFIX_PASS - EPS:
        return PASS
    return WARN if r >= SUFFIX_WARN - EPS else FAIL


def start_verdict(start_s: float | None, nospec_start_s: float | None) -> str:
    r = ratio(start_s, nospec_start_s)
    if r is None:
        return NONE
    return PASS if r <= START_MAX + EPS else FAIL


def kv_verdict(kv_tokens: float | None, nospec_kv_tokens: float | None) -> str:
    r = ratio(kv_tokens, nospec_kv_tokens)
    if r is None:
        return NONE
    return PASS if r >= KV_MIN - EPS else FAIL


def tpot_verdict(r: float | None) -> str:
    """Verdict of a served median-TPOT ratio (speculation over none)."""
    if r is None:
        return NONE
    return PASS if r <= TPOT_MAX + EPS else FAIL


def overall(verdicts: Iterable[str]) -> str:
    """The most severe of ``verdicts`` (VOID > FAIL > WARN > PASS); NONE when there is none."""
    return max(verdicts, key=SEVERITY.__getitem__, default=NONE)


def rep4_comparable(nospec: float | None, *engines: float | None) -> bool:
    """True when every engine's share of repeated 4-grams is within ``REP4_SHIFT_MAX`` of no speculation's (an
    unknown share does not exclude the cell)."""
    if nospec is None:
        return True
    return all(e is None or abs(e - nospec) <= REP4_SHIFT_MAX + EPS for e in engines)


def same_work(candidate: dict[str, Any], before: dict[str, Any]) -> bool:
    """Whether two engines did the same work on a greedy cell (``SAME_WORK_TOL``): identical output digests (not
    none) and drafted and accepted tokens within the tolerance. Each: ``{"digests", "drafted", "accepted"}``."""
    if not candidate.get("digests") or candidate.get("digests") != before.get("digests"):
        return False
    for key in ("drafted", "accepted"):
        a, b = candidate.get(key), before.get(key)
        if a is None or b is None or abs(a - b) > SAME_WORK_TOL * max(a, b, 1):
            return False
    return True


def before_after(geomean: float | None, worst: float | None, worst_set: float | None = None) -> str:
    """PASS (no loss past the noise) when a TP's counted cells' geometric mean of candidate / before is >=
    ``KEEP_GEOMEAN_MIN``, its worst prompt set's geometric mean (``worst_set``; None: not judged) >=
    ``KEEP_SET_GEOMEAN_MIN`` and its worst cell >= ``KEEP_CELL_FLOOR``; FAIL otherwise; NONE without counted cells."""
    if geomean is None or worst is None:
        return NONE
    ok = geomean >= KEEP_GEOMEAN_MIN - EPS and worst >= KEEP_CELL_FLOOR - EPS
    ok = ok and (worst_set is None or worst_set >= KEEP_SET_GEOMEAN_MIN - EPS)
    return PASS if ok else FAIL


def before_after_serve(candidate: float | None, before: float | None) -> str:
    """PASS when the candidate's serve TPOT ratio is at most before's + ``KEEP_SERVE_SLACK``."""
    if candidate is None or before is None:
        return NONE
    return PASS if candidate <= before + KEEP_SERVE_SLACK + EPS else FAIL


def wins(geomeans: list[float | None], serve: tuple[float | None, float | None]) -> bool:
    """The change wins something: a TP's geometric mean >= ``WIN_GEOMEAN``, or the serve TPOT ratio at least
    ``WIN_SERVE`` under before's."""
    if any(g is not None and g >= WIN_GEOMEAN - EPS for g in geomeans):
        return True
    cand, base = serve
    return cand is not None and base is not None and cand <= base - WIN_SERVE + EPS
