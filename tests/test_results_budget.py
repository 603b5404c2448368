"""``eval/results/`` keeps only what the docs cite, under ``RESULTS_BUDGET_BYTES``: per-step traces and raw replay
points stay out of git (``.gitignore``; INDEX.md says where earlier ones live)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "eval/results"
RESULTS_BUDGET_BYTES = 2_000_000  # counted as `du` counts a checkout: each file in whole DISK_BLOCK blocks
DISK_BLOCK = 4096
TRACE_SUFFIXES = (".traces.json.gz", ".traces.json")


def _tracked() -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "-C", str(ROOT), "ls-files", RESULTS], capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.splitlines() if line]


def test_tracked_results_stay_under_the_budget_and_hold_no_traces() -> None:
    files = [p for p in _tracked() if p.exists()]
    total = sum(-(-p.stat().st_size // DISK_BLOCK) * DISK_BLOCK for p in files)
    biggest = sorted(files, key=lambda p: p.stat().st_size)[-3:]
    largest = [p.name for p in biggest]
    assert total < RESULTS_BUDGET_BYTES, f"{RESULTS} tracks {total:,} bytes on disk; the largest: {largest}"
    assert not [p.name for p in files if p.name.endswith(TRACE_SUFFIXES)]
