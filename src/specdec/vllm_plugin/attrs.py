"""Everything the plugin stores on vLLM's objects, by object: one place to see what a vLLM upgrade must leave room
for and what the plugin's patches read back. Names only (no vLLM import, no behaviour); the modules that set and
read each attribute import it from here.
"""

from __future__ import annotations

# ----------------------------------------------------------------- VllmConfig (one engine's config, shared by its
# scheduler, runner, dispatcher and proposer in one process)
ENGINE_BOOK = "_specdec_slot_book"  # the slot book of its proposer (modes/slots.py)
ENGINE_GRAPH_STATS = "_specdec_graph_stats"  # its GraphStats: the added CUDA graphs' counts (patches/graph_stats.py)
ENGINE_SETTINGS = "_specdec_settings"  # its EngineSettings: the options resolved once (settings.py)

# ----------------------------------------------------------------- CudagraphDispatcher
NARROW_KEYS = "_specdec_narrow"  # {query length: sorted request counts captured} of the plain and narrow graphs
NARROW_Q = "_specdec_narrow_q"  # query length of the batch being dispatched (None: vLLM's)
RAGGED_OK = "_specdec_ragged_ok"  # every attention backend supports full graphs of any batch
RAGGED_KEYS = "_specdec_ragged"  # (q, request count, sorted token counts) captured, or None
RAGGED_PREFILL = "_specdec_ragged_prefill"  # the same for the prefill-carrying family, or None
RAGGED_DESC = "_specdec_ragged_desc"  # (tokens, requests, q) of the ragged key being dispatched
RAGGED_HIT = "_specdec_ragged_hit"  # q when the last dispatch returned a ragged FULL key

# ----------------------------------------------------------------- GPUModelRunner
RAGGED_Q = "_specdec_ragged_q"  # the max query length the attention metadata must state, or None

# ----------------------------------------------------------------- SchedulerOutput (TP > 1: scheduler -> ranks)
SCHEDULE_WIDTH = "specdec_schedule_width"  # the narrow width the scheduler's slot book chose for the step (0: none)

# ----------------------------------------------------------------- ModelRunnerOutput (TP > 1: driver -> scheduler)
SLOT_NOTE_ATTR = "specdec_slot_note"  # the driver's latest SlotNote (modes/tp.py, patches/tp_notes.py)
WRAPPED_OUTPUT = "_model_runner_output"  # vLLM's own: its async output keeps the ModelRunnerOutput it will send here

# ----------------------------------------------------------------- wrapped vLLM methods, our proposer class
WRAPPED = "_specdec_wrapped"  # set on every wrapper
PATCHES = "_specdec_patches"  # the names of the patches a wrapper carries (``functools.wraps`` copies it outward)
PROPOSER_MARK = "specdec_proposer"  # class attribute of ``SpecdecProposer``: a runner's drafter is ours
