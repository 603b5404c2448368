"""``InternalSettings``: how the plugin drafts where users have no say (fixed in code, not user options).

Users cannot set them: ``--speculative-config`` and ``additional_config["specdec"]`` take the user options only
(``entry/options.py``'s ``USER_KEYS``; any other key is rejected with the valid ones listed). An engine runs with
the defaults (``EngineSettings.internal``); tests and benchmarks pass other values to compare paths that must draft
the same (``ProposerCore(..., internal=...)``, ``settings.resolve(..., internal=...)``). Imports neither ``entry/``
nor ``core/`` (both layers read it) nor vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from specdec.config import ConfigBase, rng

DEADLINE_MODES = ("auto", "thread")
MAX_SLOTS = 128  # vLLM's rejection sampler limit on draft length (entry.options.MAX_SPEC_LEN)
THREAD_SPIN_US = 3000.0  # thread mode's spin before sleeping between steps
MAX_SPIN_US = 100_000.0
RAGGED_PREFILL_TOKENS = 256  # the prefill-carrying ragged family's P
MAX_RAGGED_PREFILL_TOKENS = 1 << 14


@dataclass(frozen=True)
class InternalSettings(ConfigBase):
    """The internal settings (see the module docstring); typed and range-checked like the user options."""

    deadline_mode: str = rng(
        "auto",
        choices=DEADLINE_MODES,
        doc="'thread': every draft runs on a worker thread under the deadline; 'auto': "
        "inline once AUTO_PROBE_JOBS jobs proved fast (an overrun goes back for good)",
    )
    native_step: bool = rng(True, doc="a drafter with a native one-call step runs it (same drafts as Python)")
    thread_spin_us: float = rng(
        THREAD_SPIN_US,
        lo=0.0,
        hi=MAX_SPIN_US,
        doc="thread mode: the drafter's thread and the engine thread spin this long before sleeping between steps",
    )
    device_wait: bool = rng(
        True,
        doc="schedule mode: the GPU, not the host, waits for a step's drafts (a stream "
        "wait on a pinned word; falls back to host fills by itself)",
    )
    matrix_step: bool = rng(True, doc="schedule mode: the drafting reads the captured token matrix in one call")
    early_refresh: bool = rng(True, doc="schedule mode: stale global-cache fronts are rebuilt while the GPU runs")
    prefill_step_slots: int = rng(
        0,
        lo=-1,
        hi=MAX_SLOTS,
        doc="adaptive slots: draft slots per decoding request on a heavy prefill step (compute-bound; -1: no cap)",
    )
    ragged_prefill_tokens: int = rng(
        RAGGED_PREFILL_TOKENS,
        lo=0,
        hi=MAX_RAGGED_PREFILL_TOKENS,
        doc="ragged graphs: prompt chunks of at most this many tokens ride in them too (a second family; 0: off)",
    )
    min_path_prob: float = rng(0.0, lo=0.0, hi=1.0, doc="drop draft tokens of a lower path probability")
    min_path_prob_per_seq: float = rng(0.0, lo=0.0, hi=1.0, doc="that floor grows by this much per running request")

    @classmethod
    def split(cls, data: Mapping[str, Any], *, where: str = "") -> tuple[dict[str, Any], InternalSettings]:
        """(the keys of ``data`` that are not internal settings, the internal settings ``data`` sets): for tests
        and benchmarks that describe one configuration in one dict. Never for users' dicts."""
        names = {f.name for f in fields(cls)}
        rest = {k: v for k, v in data.items() if k not in names}
        return rest, cls.from_dict({k: v for k, v in data.items() if k in names}, where=where)


INTERNAL_KEYS = frozenset(f.name for f in fields(InternalSettings))
