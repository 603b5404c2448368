"""Projected speedup of speculative decoding from replay counts and a verify-cost model.

    speedup = MAT * t(1) / (t(1 + drafted_per_step) + t_draft_per_step + t_update_per_step)

``t(n)`` is the target's time for one decode step that scores ``n`` tokens (the root plus the drafted nodes).
Plain decoding costs ``t(1)`` per token; speculation costs one verify step plus the CPU's drafting and update
time per step, and emits MAT tokens per step. The synchronous formula assumes drafting is not overlapped with
verification (vLLM runs CPU drafters synchronously); ``hidden_draft_speedup`` assumes drafting is fully hidden
behind verification (the async pipeline's best case): ``MAT * t(1) / max(t(1 + drafted), t_draft + t_update)``.

Default ``t(n)``: ``t(1) = 5.0 ms`` and ``+0.02 ms`` per extra scored token, a linear fit of an 8B-shaped target
at batch 1 on one H100-class GPU (the project brief's 5.0 ms decode step; a decode step of a few tokens is
memory-bound, so extra tokens cost little). Give your own with ``--verify-ms`` / ``--verify-ms-per-token``,
a measured table with ``--verify-table 1:5.0,9:5.2,17:5.5`` (linear interpolation, flat beyond the ends), or
measure the target on this machine with ``specdec-eval live`` (it reports the real wall-clock speedup).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specdec.config import ConfigError, check_number

DEFAULT_VERIFY_MS = 5.0
DEFAULT_VERIFY_MS_PER_TOKEN = 0.02
MAX_VERIFY_MS = 60_000.0  # a verify step of a minute: past any target this models
MS = 1e-3
US = 1e-6


@dataclass(frozen=True)
class CostModel:
    """t(n) in seconds: a table (n -> ms) when given, else ``t1_ms + per_token_ms * (n - 1)``."""

    t1_ms: float = DEFAULT_VERIFY_MS
    per_token_ms: float = DEFAULT_VERIFY_MS_PER_TOKEN
    table: tuple[tuple[int, float], ...] = field(default=())
    source: str = "default: an 8B-shaped target at batch 1 on an H100-class GPU, + 0.02 ms per extra scored token"

    def __post_init__(self) -> None:
        """Finite times in range (``MAX_VERIFY_MS``), table entries too, each n once; else ``ConfigError`` naming the
        flag, the value and the range."""
        t1 = check_number("--verify-ms", self.t1_ms, kind=float, above=0.0, hi=MAX_VERIFY_MS)
        per = check_number("--verify-ms-per-token", self.per_token_ms, kind=float, lo=0.0, hi=MAX_VERIFY_MS)
        pts = sorted(
            (
                check_number("--verify-table n", n, kind=int, lo=1, hint="tokens scored in one step"),
                check_number("--verify-table ms", ms, kind=float, above=0.0, hi=MAX_VERIFY_MS),
            )
            for n, ms in self.table
        )
        twice = sorted({n for (n, _), (m, _) in zip(pts, pts[1:]) if n == m})
        if twice:
            raise ConfigError(f"--verify-table gives n={twice[0]} twice; give one time per n")
        object.__setattr__(self, "t1_ms", t1)
        object.__setattr__(self, "per_token_ms", per)
        object.__setattr__(self, "table", tuple(pts))

    @classmethod
    def parse_table(cls, text: str, **kw: Any) -> CostModel:
        """``"1:5.0,9:5.2,17:5.5"`` -> a table model (t(1) read from the table)."""
        try:
            pts = tuple((int(a), float(b)) for a, b in (item.split(":") for item in text.split(",") if item.strip()))
        except ValueError:
            raise ConfigError(
                f"--verify-table {text!r}: expected comma-separated n:ms pairs like 1:5.0,9:5.2"
            ) from None
        if not pts:
            raise ConfigError(f"--verify-table {text!r} is empty; expected n:ms pairs like 1:5.0,9:5.2")
        return cls(table=pts, source=f"table {text}", **kw)

    def verify_ms(self, n: float) -> float:
        """Milliseconds to verify ``n`` tokens in one step (n may be fractional: an average)."""
        if not self.table:
            return self.t1_ms + self.per_token_ms * max(n - 1.0, 0.0)
        pts = self.table
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, m0), (n1, m1) in zip(pts, pts[1:]):
            if n <= n1:
                return m0 + (m1 - m0) * (n - n0) / (n1 - n0)
        return pts[-1][1]

    @property
    def base_ms(self) -> float:
        return self.verify_ms(1)

    def project(self, result: Mapping[str, Any]) -> dict[str, float]:
        """Projected speedups for one result dict (needs mat, drafted_per_step, draft/update µs per step)."""
        mat = float(result.get("mat", 0.0))
        steps = max(int(result.get("steps", 0)), 1)
        emitted = float(result.get("emitted_tokens", 0))
        per_step_cpu_ms = (
            (float(result.get("draft_us_per_token", 0.0)) + float(result.get("update_us_per_token", 0.0)))
            * emitted
            / steps
            * 1e-3
        )
        verify = self.verify_ms(1.0 + float(result.get("drafted_per_step", 0.0)))
        base = self.base_ms
        sync = mat * base / (verify + per_step_cpu_ms) if mat else 0.0
        hidden = mat * base / max(verify, per_step_cpu_ms) if mat else 0.0
        return {
            "projected_speedup": sync,
            "hidden_draft_speedup": hidden,
            "verify_ms_per_step": verify,
            "cpu_ms_per_step": per_step_cpu_ms,
        }

    def describe(self) -> dict[str, Any]:
        return {
            "t1_ms": self.base_ms,
            "per_token_ms": self.per_token_ms if not self.table else None,
            "table": [list(p) for p in self.table] or None,
            "source": self.source,
            "formula": "MAT * t(1) / (t(1 + drafted_per_step) + draft_ms_per_step + update_ms_per_step)",
        }
