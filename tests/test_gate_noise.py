"""What one before/after run resolves (``benchmarks.gate_noise``): same-work cells pooled across runs, the split of
their log-ratios into a run's offset and a cell's scatter, and what the rule makes of a change that does nothing."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import gate_noise as gn
from benchmarks import gate_rules as rules


def _doc(ratios: dict[str, float], *, other: dict[str, float] | None = None) -> dict:
    """A TP=1 gate whose listed cells did the same work at candidate / before = ratio (``other``: different outputs)."""
    eng: dict[str, dict] = {m: {"cells": {}} for m in ("nospec", "specdec", "specdec-before")}
    for key, r in {**ratios, **(other or {})}.items():
        same = key in ratios
        eng["nospec"]["cells"][key] = {"runs": [{"tokens_per_s": 100.0}] * 2, "repeat4": 0.5, "digests": ["n"]}
        for m, tps, digest in (("specdec", 200.0 * r, "a"), ("specdec-before", 200.0, "a" if same else "b")):
            run = {"tokens_per_s": tps, "draft_tokens": 500.0, "accepted_tokens": 300.0, "emitted_per_step": 2.0}
            eng[m]["cells"][key] = {"runs": [run], "repeat4": 0.5, "digests": [digest]}
    return {"kind": "specdec-gate", "gates": {"tp1": {"engines": eng}}}


def test_only_same_work_cells_are_pooled_per_run():
    runs = gn.same_work_runs({"A": _doc({"chat/b1": 1.1, "code/b1": 0.9}, other={"agentic/b8": 0.5})})
    assert len(runs) == 1 and runs[0]["tp"] == "tp1"
    assert runs[0]["cells"] == {"chat/b1": pytest.approx(math.log(1.1)), "code/b1": pytest.approx(math.log(0.9))}


def test_the_variance_splits_into_a_run_offset_and_a_cell_scatter():
    # two runs: offsets +0.1 and -0.1 in log, each cell +-0.05 around its run's offset
    runs = [{"cells": {"a": 0.15, "b": 0.05}}, {"cells": {"a": -0.05, "b": -0.15}}]
    within, between = gn.split_variance(runs)
    assert within == pytest.approx(math.sqrt((4 * 0.05**2) / 2))  # 4 squared deviations, 2 degrees of freedom
    # the run means +-0.1: variance 0.02, less within^2 / 2 cells = 0.0025 -> 0.0175
    assert between == pytest.approx(math.sqrt(0.02 - 0.0025))
    same = [{"cells": {"a": 0.1, "b": -0.1}}, {"cells": {"a": 0.1, "b": -0.1}}]
    assert gn.split_variance(same)[1] == 0.0  # equal run means: no offset


def test_a_change_that_does_nothing_reads_as_loss_or_win_by_the_normal_tail():
    n = gn.null_change(0.0, 0.02, tp_cells=12, set_cells=4)  # only a run offset of SD 0.02
    assert n["tp_geomean_sd"] == pytest.approx(0.02) and n["set_geomean_sd"] == pytest.approx(0.02)
    z = math.log(rules.KEEP_GEOMEAN_MIN) / 0.02  # about -1.01
    assert n["p_tp_loss"] == pytest.approx(0.5 * math.erfc(-z / math.sqrt(2)))
    assert 0.15 < n["p_tp_loss"] < 0.16 and 0.15 < n["p_tp_win"] < 0.17
    assert gn.null_change(0.04, 0.0, tp_cells=16, set_cells=4)["tp_geomean_sd"] == pytest.approx(0.01)
    assert gn.below(0.98, 0.0) == 0.0


def test_the_command_reads_paths_and_writes_the_summary(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc({"chat/b1": 1.1, "code/b1": 1.0})))
    b.write_text(json.dumps(_doc({"chat/b1": 0.9, "code/b1": 0.95})))
    out = gn.main([str(a), str(b), "--out", str(tmp_path / "n.json")])
    assert out["cells"] == 4 and len(out["runs"]) == 2
    assert out["geomean"] == pytest.approx((1.1 * 1.0 * 0.9 * 0.95) ** 0.25)
    assert json.loads((tmp_path / "n.json").read_text())["cells"] == 4
    assert "4 same-work cells in 2 runs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gn.main([str(a)])  # one run: no split
