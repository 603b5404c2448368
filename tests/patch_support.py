"""Rows of the patch table (``specdec.vllm_plugin.patches.table``) applied to the tests' own classes."""

from __future__ import annotations

from typing import Any

from specdec.vllm_plugin.patches.features import Feature
from specdec.vllm_plugin.patches.table import TABLE, PatchReport, apply_patches, wrap_row
from specdec.vllm_plugin.versions import TESTED_VLLM_VERSIONS

TESTED = TESTED_VLLM_VERSIONS[0]


def patch(target: Any, *features: Feature, targets: tuple[str, ...] = ()) -> PatchReport:
    """Apply the rows of ``features`` (only rows whose vLLM target is in ``targets``, if given) to ``target`` (every
    row's vLLM target resolves to it), checks included, as on a tested vLLM; the report says which applied
    (``report.on(feature)``)."""
    rows = tuple(r for r in TABLE if r.feature in features and (not targets or r.target in targets))
    return apply_patches("all", version=TESTED, resolver=lambda name: target, table=rows)


def wrap_unchecked(target: Any, *features: Feature, targets: tuple[str, ...] = ()) -> int:
    """Wrap the methods ``target`` has of the rows of ``features`` (only rows whose vLLM target is in ``targets``,
    if given) without the rows' checks: fakes of vLLM's classes whose source differs. Returns the rows applied."""
    rows = [r for r in TABLE if r.feature in features and (not targets or r.target in targets)]
    return sum(wrap_row(r, target) for r in rows if hasattr(target, r.method))
