"""``EngineSettings``: one engine's options resolved once (the mode, k, the CUDA-graph widths, what the drafting core
runs with, the internal settings), made on first use and kept on the engine's vLLM config, so the proposer, the modes
and the patches read one resolution instead of each parsing ``additional_config["specdec"]`` again. Never imports
vLLM.

(``patches.async_sched.wants_schedule`` runs inside ``VllmConfig.__post_init__``, before the config is final: it
asks the same parser and the same mode decision, ``options.schedule_mode_for``, without keeping the result.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from specdec.vllm_plugin.attrs import ENGINE_SETTINGS
from specdec.vllm_plugin.entry.options import (
    SpecdecOptions,
    async_mode_for,
    options_from_vllm_config,
    resolve_lane_threads,
    schedule_mode_for,
)
from specdec.vllm_plugin.internal import InternalSettings
from specdec.vllm_plugin.modes.slots import narrow_widths
from specdec.vllm_plugin.patches.async_sched import is_our_config

PLAIN_WIDTH = 0  # the width of a step that verifies no draft (one token per request): patches/narrow_keys.py
PLAIN_GRAPHS = True  # such steps get the one-token FULL graphs no speculation replays
# A plain or narrow step of more requests than its own FULL graphs hold replays the ragged FULL graphs (which hold any
# batch of at most max_num_seqs requests of at most k + 1 tokens each, patches/ragged_keys.py) instead of vLLM's
# piecewise ones, where the engine has ragged graphs. Off until the GPU gate has measured it.
UNIFORM_PAST_LADDER_RAGGED = False


@dataclass(frozen=True)
class EngineSettings:
    """One engine's resolved options (see the module docstring)."""

    options: SpecdecOptions  # the user's options, async_mode resolved
    internal: InternalSettings  # the internal settings (fixed in code; tests vary them through ``resolve``)
    schedule: bool  # drafting under vLLM's async scheduling ("schedule" mode)
    threaded: bool  # thread mode
    narrow_widths: tuple[int, ...]  # the widths a narrow step of these options may have (modes.slots.narrow_widths)
    graph_widths: tuple[int, ...]  # widths of the uniform FULL graphs added: plain, then schedule mode's narrow ones
    ragged_prefill_tokens: int  # the prefill-carrying ragged family's P (0: none; -1: no ragged graphs)

    @property
    def k(self) -> int:
        """The most draft tokens per request and step: vLLM's speculative config's, the one source."""
        return self.options.num_speculative_tokens

    def core_options(self) -> SpecdecOptions:
        """What the drafting core runs with: lane threads resolved for the mode; schedule mode with uniform slots
        pads every row to k (its slots are k whatever the drafts)."""
        opts = self.options
        core = opts.replace(lane_threads=resolve_lane_threads(opts.lane_threads, schedule=self.schedule))
        if self.schedule and opts.draft_slots == "uniform":
            core = core.replace(pad_drafts="on")
        return core


def resolve(vllm_config: Any, *, internal: InternalSettings | None = None) -> EngineSettings:
    """``EngineSettings`` of a vLLM config that runs our proposer (raises a ``ConfigError`` on bad options);
    ``internal``: other internal settings than the defaults (tests, benchmarks)."""
    internal = InternalSettings() if internal is None else internal
    opts = options_from_vllm_config(vllm_config)
    if opts.async_mode == "auto":
        opts = opts.replace(async_mode=async_mode_for("auto", vllm_config))
    schedule = schedule_mode_for(opts, vllm_config)
    plain = (PLAIN_WIDTH,) if PLAIN_GRAPHS else ()
    narrow = narrow_widths(opts)
    ragged = -1
    if schedule and opts.ragged_graphs:
        ragged = 0 if getattr(vllm_config, "lora_config", None) else internal.ragged_prefill_tokens
    return EngineSettings(
        options=opts,
        internal=internal,
        schedule=schedule,
        threaded=opts.async_drafting and opts.async_mode == "thread",
        narrow_widths=narrow,
        graph_widths=plain + (narrow if schedule else ()),
        ragged_prefill_tokens=ragged,
    )


def engine_settings(vllm_config: Any) -> EngineSettings | None:
    """The settings of the engine whose config is ``vllm_config``, resolved on first use and kept on it; None for
    an engine that does not run our proposer."""
    if not is_our_config(vllm_config):
        return None
    settings = getattr(vllm_config, ENGINE_SETTINGS, None)
    if settings is None:
        settings = resolve(vllm_config)
        with contextlib.suppress(AttributeError, TypeError):
            object.__setattr__(vllm_config, ENGINE_SETTINGS, settings)
    return settings
