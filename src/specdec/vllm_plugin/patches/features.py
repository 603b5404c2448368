"""The features the vLLM patches serve (``Feature``): each one's name in the start-up line and what runs without it.

A feature is on only when every row of ``patches.table`` serving it applied (and the feature it needs, ``NEEDS``,
is on). The name of a feature also marks the wrappers of its rows (``common.mark``), so one vLLM method wrapped
for two features carries both names.
"""

from __future__ import annotations

import enum


class Feature(enum.Enum):
    """(name in the start-up line, what runs without it)."""

    METHOD = ("method='specdec'", "only the custom_class form works")
    SCHEDULE = ("schedule", "vLLM schedules synchronously")
    REQUEST_IDS = ("request ids", "request ids read from the caller's frame")
    THREAD_HAND_OFF = ("thread hand-off", "thread mode collects its drafts in propose")
    NEAR_END = (
        "drafts near max_model_len",
        "while a request is within k tokens of max_model_len, the batch verifies zeros",
    )
    ADAPTIVE_SLOTS = ("adaptive slots", "every request keeps vLLM's k draft slots")
    SLOT_REGRANT = ("slot re-grant", "slots trimmed as vLLM hands them out: one drafting round older, no prefill cap")
    TP_SCHEDULE = ("tensor-parallel schedule", "TP > 1 drafts in thread mode")
    NARROW_GRAPHS = ("narrow graphs", "no narrow steps (per-request slots)")
    RAGGED_GRAPHS = ("ragged graphs", "ragged verify batches run vLLM's piecewise graphs")
    GRAPH_LOG = ("added-graph log", "no log line of what the added CUDA graphs cost")
    COMPILE_WARMUP = ("compile warm-up", "vLLM's batch-change correction compiles at first use")
    CLI_CHECK = ("--speculative-config check", "bad options fail when the engine starts, not as argparse errors")

    def __init__(self, label: str, fallback: str) -> None:
        self.label = label
        self.fallback = fallback


NEEDS = {  # feature -> the feature whose wrappers it works through
    Feature.SLOT_REGRANT: Feature.ADAPTIVE_SLOTS,
    Feature.RAGGED_GRAPHS: Feature.NARROW_GRAPHS,
    Feature.GRAPH_LOG: Feature.NARROW_GRAPHS,
}
ANY_VLLM = frozenset({Feature.METHOD, Feature.CLI_CHECK})  # applied on any vLLM, in the tested span or not
