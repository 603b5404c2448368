"""One engine's counts of the CUDA graphs the plugin adds (``graphs.py``, ``ragged_keys.py``): keys made, batches
dispatched to them or not, and what capturing them cost.

An engine's runner, its CUDA-graph dispatcher and our proposer share one ``VllmConfig`` object, so the counts live
on it (``graph_stats_of``), as the slot book does (``modes.slots.attach_book``): the dispatcher's wrappers count, the
proposer reads its own engine's counts (its statistics, the slot book's ``high_ragged`` question), and two engines
in one process keep theirs apart. Never imports vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

from specdec.vllm_plugin.attrs import ENGINE_GRAPH_STATS


@dataclass
class GraphStats:
    """Counts of one engine's added graphs (see the module docstring)."""

    narrow_full: int = 0  # narrow batches replayed from a FULL graph of ours (plain ones included)
    plain_full: int = 0  # of them, plain batches (one token per request: no draft verified)
    narrow_piecewise: int = 0  # narrow batches no key of ours held: vLLM's mixed-batch graphs
    narrow_keys: int = 0  # narrow FULL keys made
    ragged_full: int = 0  # ragged batches replayed from a FULL graph of ours
    ragged_piecewise: int = 0  # ragged batches no key of ours held (or FULL not allowed)
    ragged_keys: int = 0  # ragged FULL keys made
    ragged_prefill_full: int = 0  # the same for batches carrying prompt chunks
    ragged_prefill_keys: int = 0
    added_graphs_captured: int = 0  # captures of our keys (memory profile and capture_model)
    added_graph_bytes: int = 0  # device memory they took
    added_graph_s: float = 0.0  # and their seconds
    added_graphs_logged: int = 0  # 1 once their cost was logged (``graphs.log_added_graphs``)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def full_dispatches(self) -> int:
        """Batches replayed from a FULL graph of ours so far (narrow, ragged, ragged with prompt chunks)."""
        return self.narrow_full + self.ragged_full + self.ragged_prefill_full

    def ragged_ready(self) -> bool:
        """True once this engine made ragged keys (its slot book then gives high-MAT steps per-request slots)."""
        return self.ragged_keys > 0


def graph_stats_of(vllm_config: Any) -> GraphStats:
    """The ``GraphStats`` of the engine whose config is ``vllm_config``, made on first use. A config that takes no
    attribute gets fresh counts each call (counted, never read back: the graphs themselves are unaffected)."""
    stats = getattr(vllm_config, ENGINE_GRAPH_STATS, None)
    if stats is None:
        stats = GraphStats()
        with contextlib.suppress(AttributeError, TypeError):
            object.__setattr__(vllm_config, ENGINE_GRAPH_STATS, stats)
    return stats


def dispatcher_stats(dispatcher: Any) -> GraphStats:
    """The ``GraphStats`` of the engine a CUDA-graph dispatcher belongs to (its ``vllm_config``; the dispatcher
    itself where it has none)."""
    config = getattr(dispatcher, "vllm_config", None)
    return graph_stats_of(dispatcher if config is None else config)
