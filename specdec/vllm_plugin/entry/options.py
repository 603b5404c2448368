"""Typed, validated options of the vLLM plugin (the keys of ``--speculative-config`` beside vLLM's own).

    {"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 16, "draft_timeout_ms": 20}

``split_speculative_config`` separates a user's dict into the keys vLLM's ``SpeculativeConfig`` knows and ours;
``SpecdecOptions.from_dict`` validates ours (unknown key -> ``ConfigError`` naming it and the valid keys).
This module never imports vLLM (CPU tests and CI use it directly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from specdec.config import ConfigBase, ConfigError, rng
from specdec.vllm_plugin.core.slots import SLOT_MODES, usable_width

METHOD = "specdec"  # the friendly method name users write
PROPOSER_PATH = "specdec.vllm_plugin.proposer.SpecdecProposer"  # the custom_class it becomes
ADDITIONAL_CONFIG_KEY = "specdec"  # where our options travel: vllm_config.additional_config["specdec"]
MAX_SPEC_LEN = 128  # vLLM's rejection sampler limit on draft length

# Keys of vLLM's SpeculativeConfig that may appear beside ours in a "specdec" dict (passed through to vLLM).
VLLM_KEYS = frozenset({
    "method", "model", "num_speculative_tokens", "enforce_eager", "draft_tensor_parallel_size",
    "disable_padded_drafter_batch", "num_speculative_tokens_per_batch_size", "rejection_sample_method",
    "draft_sample_method", "synthetic_acceptance_rates", "synthetic_acceptance_length", "max_model_len",
})
PAD_CHOICES = ("auto", "on", "off", True, False)
KEY_ALIASES = {"async": "async_drafting"}  # `async` is a Python keyword; users write "async": true
ASYNC_MODES = ("auto", "thread", "schedule")
AUTO_SCHEDULE_MIN_PARAMS = 1e9  # async_mode "auto": targets this large draft in "schedule" mode (one GPU), else "thread"
SCHEDULE_LANE_THREADS = 4  # lane_threads 0 ("auto") in schedule mode (GPU run 64)
# suffix drafts <= their match length where verified tokens cost (GPU runs 70-72: +2-10% at batch 32-64), <= 8x
# it where rows are padded to k anyway (run 74: the 1x cap lost 10% at batch 1-8 on code prompts)
VLLM_SUFFIX_SPEC_FACTOR = 1.0
VLLM_SUFFIX_FREE_SPEC_FACTOR = 8.0
# suffix tries half as deep as the library's 64 beside vLLM: the engine thread's stops and the drafting the GPU waits
# for cost ~27% less at code batch 64 on the 2-core CPU, MAT -0.3% on the OpenHands replay, GPU run 133: code batch 64
# waits 3.8% of the step instead of 4.4% at +0.6% tokens/s
VLLM_SUFFIX_MAX_DEPTH = 32


@dataclass(frozen=True)
class SpecdecOptions(ConfigBase):
    """Options of the specdec proposer inside vLLM (snake_case keys of the speculative config)."""

    drafter: Any = rng("suffix", doc="drafter name ('suffix', 'ngram', 'model'), {'name': ..., opts} or a list")
    drafter_options: dict = rng({}, doc="per-drafter option dicts, e.g. {'suffix': {'max_depth': 32}}")
    draft_model: str = rng("", doc="shorthand for drafter_options={'model': {'path': ...}}: the draft model folder "
                                   "(same tokenizer as the served model; checked at start)")
    num_speculative_tokens: int = rng(16, lo=1, hi=MAX_SPEC_LEN, doc="max draft tokens per request per step")
    async_drafting: bool = rng(True, doc="draft off the critical path (key: 'async'; false: the synchronous path); "
                                         "how: async_mode")
    async_mode: str = rng("auto", choices=ASYNC_MODES,
                          doc="'auto': 'schedule' for a target of at least 1e9 parameters on one GPU (TP = PP = 1), "
                              "else 'thread'; 'schedule': vLLM's async scheduling, drafts filled into a GPU buffer "
                              "just before vLLM reads them; 'thread': the suffix drafter's native step runs on its "
                              "own thread while vLLM processes the step's outputs")
    draft_timeout_ms: float = rng(50.0, lo=0.0, hi=60_000.0,
                                  doc="per-step drafting deadline; past it the step gets no draft (0 = no deadline)")
    deadline_mode: str = rng("auto", choices=("auto", "thread"),
                             doc="'thread': every draft runs on a worker thread under the deadline; 'auto': so "
                                 "does a new drafter, until 64 jobs (all but one) took < 1/4 of the deadline, then drafting "
                                 "runs inline (no hand-off) and an overrun switches back to 'thread' for good")
    native_step: bool = rng(True, doc="a drafter with a native one-call step (suffix, native backend) runs every "
                                      "row's bookkeeping, drafting and cut in one C++ call (same drafts as the "
                                      "Python path); needs deadline_mode='auto' (inline, overrun -> Python path)")
    thread_spin_us: float = rng(3000.0, lo=0.0, hi=100_000.0,
                                doc="async_mode='thread': after a step the drafter's thread looks for the next one "
                                    "awake for up to this long, and the engine thread spins that long before "
                                    "sleeping while it waits for drafts (saves thread wake-ups, keeps a core busy)")
    lane_threads: int = rng(0, lo=0, hi=64,
                            doc="threads that share the rows of one step's drafting with the native step (the "
                                "drafting thread and lane_threads - 1 helpers that sleep between steps; every mode: "
                                "the engine thread's lane_step in schedule and synchronous modes, the lane thread's "
                                "job in thread mode); same drafts for every value. 0 (default): "
                                f"{SCHEDULE_LANE_THREADS} in schedule mode, where the GPU waits for the drafting "
                                "(GPU run 64, 8B-sized target, sustained load, batch 64: GPU waiting for drafts "
                                "8.2 -> 5.0% code, 3.9 -> 3.5% agentic), 1 elsewhere (thread mode, GPU run 37: the "
                                "job fell from 410 to 235 us with 4, end to end unresolved)")
    device_wait: bool = rng(True, doc="async_mode='schedule': the GPU, not the host, waits for a step's drafts "
                                      "(a CUDA stream wait on a pinned word; drafting at the start of _model_forward, "
                                      "after vLLM enqueued the step's inputs; a watchdog frees the stream draft_timeout_ms after the GPU "
                                      "started waiting, or 2 s after the wait was enqueued); "
                                      "false or unavailable: drafts filled on the host before vLLM reads them")
    matrix_step: bool = rng(True, doc="async_mode='schedule' with the native step: the drafting the GPU waits for "
                                      "reads the captured token matrix and writes the padded drafts into the draft "
                                      "buffer in one native call; the host's token record is updated after the "
                                      "GPU's release (same drafts; false: Python rows and padding first)")
    draft_slots: str = rng("adaptive", choices=SLOT_MODES,
                           doc="async_mode='schedule': 'adaptive': each request's next step reserves as many draft "
                               "slots as its latest draft has tokens past the confidence cut (vLLM verifies only "
                               "those; specdec.vllm_plugin.core.slots); 'uniform': k slots for every request (vLLM's "
                               "async scheduling)")
    early_refresh: bool = rng(True, doc="async_mode='schedule' with the device wait: rebuild the global-cache match "
                                        "fronts that stops made stale while the GPU still runs the previous step "
                                        "(else while drafting, the GPU waiting); same drafts")
    prefill_step_slots: int = rng(0, lo=-1, hi=MAX_SPEC_LEN,
                                  doc="draft_slots='adaptive': on a step that will also carry a heavy prefill (at "
                                      "least 512 prompt tokens of waiting requests or prompts still being chunked) "
                                      "every decoding request verifies at most this many draft tokens (such steps "
                                      "are compute-bound: each verified token costs its full share of the GEMMs); "
                                      "-1: no cap. GPU runs 58-60, 8B-sized target, sustained load: agentic +1-5% "
                                      "at batch 32-64, code unchanged")
    slot_growth: float = rng(1.0, lo=0.0, hi=16.0,
                             doc="draft_slots='adaptive': a request's next step gets L + ceil(slot_growth * L) slots "
                                 "for a latest draft of L tokens (the slots follow the drafts one round late; a "
                                 "suffix draft grows as its match is accepted), while the extra slots pay: the "
                                 "share of them holding an accepted token must reach the cost model's token cost. "
                                 "0: the latest draft's length")
    slot_growth_min_share: float = rng(0.15, lo=0.0, hi=1.0,
                                       doc="slot_growth's extra slots must also hold an accepted token at least this "
                                           "often (the cost fit underrates them: GPU runs 78-79, agentic batch 64 "
                                           "lost 3-5% with growth while its fitted token cost was 0.12)")
    adaptive_slots_from: int = rng(16, lo=1, hi=1 << 16,
                                   doc="draft_slots='adaptive' with pad_drafts='auto': below this many running "
                                       "requests every row keeps k slots and is padded (uniform batches run full "
                                       "CUDA graphs). GPU runs 49-54, 8B-sized target: adaptive slots lost at "
                                       "batch 8 (-10%), won at batch 64 on agentic prompts (+13-15%); run 54, same "
                                       "run: from 16 rows vs from 48, +1.6% / +4.9% at batch 32 (code / agentic), "
                                       "-0.9% / +4.7% at batch 64")
    narrow_slots: int = rng(6, lo=0, hi=MAX_SPEC_LEN,
                            doc="draft_slots='adaptive': from adaptive_slots_from up to narrow_slots_below running "
                                "requests every decoding request gets exactly this many draft slots, padded with "
                                "the drafter's chain, so the verify batch is uniform and runs as one FULL CUDA graph; "
                                "the plugin captures those graphs beside vLLM's 1 + k ones (specdec.vllm_plugin."
                                "graphs). GPU runs 84-85, 8B-sized target, batch 32: k = 6 with uniform slots beat "
                                "k = 16 with adaptive slots by 6-14%, and lost 26-28% at batch 64 on code prompts. "
                                "0, or >= num_speculative_tokens: off")
    ragged_graphs: bool = rng(True, doc="async_mode='schedule': verify batches whose requests carry different draft "
                                        "lengths (each at most "
                                        "k + 1 tokens: per-request slots, steps without drafts) "
                                        "run as FULL CUDA graphs, one per capture size, captured for max_num_seqs "
                                        "requests and a max query length of k + 1, which the attention metadata "
                                        "then states at every replay (specdec.vllm_plugin.patches.ragged_keys); only "
                                        "where every attention backend supports full graphs of any batch "
                                        "(FlashAttention 3, Triton, Flex). false: such batches run vLLM's "
                                        "piecewise graphs")
    ragged_prefill_tokens: int = rng(256, lo=0, hi=1 << 14,
                                     doc="ragged_graphs: verify batches that also carry prompt chunks of at most "
                                         "this many tokens each (short prompts joining a running batch) run as "
                                         "FULL CUDA graphs too, a second family captured and replayed with this "
                                         "max query length (specdec.vllm_plugin.patches.ragged_keys); without LoRA only. 0, or "
                                         "<= num_speculative_tokens + 1: off (such steps run piecewise graphs)")
    narrow_slots_below: int = rng(48, lo=0, hi=1 << 16,
                                  doc="narrow_slots: running requests below which a step's slots are narrow "
                                      "(measured at 32 and 64 running requests only)")
    large_batch_narrow_slots: int = rng(4, lo=0, hi=MAX_SPEC_LEN,
                                        doc="draft_slots='adaptive': from narrow_slots_below running requests, steps "
                                            "are narrow with this many slots while the tokens a request gets per "
                                            "step (MAT, a moving average) stay at most large_batch_narrow_max_mat: "
                                            "drafts that are seldom accepted gain more from one full CUDA graph "
                                            "than from their slots. GPU run 92, 8B-sized target, batch 64: agentic "
                                            "prompts (MAT 2.0) +7.5%, code prompts (MAT 6.4, kept out by the MAT "
                                            "test) -11%. 0, or >= num_speculative_tokens: off")
    large_batch_narrow_max_mat: float = rng(3.0, lo=1.0, hi=MAX_SPEC_LEN + 1.0,
                                            doc="large_batch_narrow_slots: the MAT at or below which large batches "
                                                "are narrow")
    high_mat_narrow_slots: int = rng(8, lo=0, hi=MAX_SPEC_LEN,
                                     doc="narrow_slots: mid-size narrow steps get this many slots instead while "
                                         "the tokens a request gets per step (MAT, a moving average) are at least "
                                         "high_mat_narrow_min_mat: long accepted drafts (code) pay for a wider "
                                         "uniform batch, seldom accepted ones (agentic) do not. GPU run 97, "
                                         "8B-sized target, batch 32: width 8 on code prompts 15,671 tok/s (MAT "
                                         "5.47; width 6: 14,307-15,619 in runs 89-96), on agentic prompts 4,360 "
                                         "(width 6: 4,577-4,616). 0, or >= num_speculative_tokens: off")
    high_mat_ragged: bool = rng(True, doc="ragged_graphs: while the moving MAT is at least high_mat_narrow_min_mat, "
                                          "mid-size steps give each request its own slots (a ragged batch, one "
                                          "FULL graph) instead of high_mat_narrow_slots, once the engine captured "
                                          "the ragged graphs (graphs.ragged_ready). GPU run 137 (same lease), code "
                                          "batch 32: 16,820 tok/s (MAT 6.23) against 15,901 (MAT 5.39) at width 8; "
                                          "agentic prompts (MAT 2.8) stay narrow at width 6, where per-request "
                                          "slots lost 6% (run 140). false: high_mat_narrow_slots")
    high_mat_narrow_min_mat: float = rng(4.0, lo=1.0, hi=MAX_SPEC_LEN + 1.0,
                                         doc="high_mat_narrow_slots: the MAT from which mid-size narrow steps are "
                                             "that wide (MAT at width 6, run 95: code 4.71, agentic 2.77; at width 8, "
                                             "run 97: 5.47 and 2.87)")
    strict: bool = rng(False, doc="re-raise drafter errors (debugging only: a failure then fails the engine)")
    adaptive: bool = rng(True, doc="skip or shorten drafting when it cannot pay (batch size, acceptance)")
    min_path_prob: float = rng(0.0, lo=0.0, hi=1.0,
                               doc="drop draft tokens whose path probability (drafter's estimate) is lower")
    min_path_prob_per_seq: float = rng(0.0, lo=0.0, hi=1.0,
                                       doc="adaptive: the fixed floor grows by this much per running request")
    min_acceptance: float = rng(0.1, lo=0.0, hi=1.0,
                                doc="adaptive: a request whose acceptance EMA falls below drafts 1 token")
    pad_drafts: Any = rng("auto", doc="'on': every decoding request submits exactly k draft tokens (the drafter's "
                                      "chain past its confidence cut, then filler), so vLLM runs the verify batch as "
                                      "a FULL CUDA graph; 'auto': pad a step when the padded tokens' estimated GPU "
                                      "compute is under 10% of the step period (small targets, small batches); 'off'")
    cudagraph_max_tokens: int = rng(-1, lo=-1, hi=1 << 16,
                                    doc="-1: raise vLLM's max_cudagraph_capture_size to max_num_seqs x (k+1) "
                                        "(at most 2048) when the user set no capture sizes, so verify batches "
                                        "stay in CUDA graphs; 0: leave vLLM's default; N: use N")
    draft_ranks: str = rng("driver", choices=("driver", "all"),
                           doc="TP>1: 'driver' = only TP rank 0 drafts (the others' drafts are never read)")
    log_every_s: float = rng(60.0, lo=0.0, hi=86_400.0, doc="log drafting stats this often (0 = never)")

    def resolved_drafter_options(self, target_tokenizer: str = "") -> dict[str, dict[str, Any]]:
        """``drafter_options`` with ``draft_model`` and the served model's tokenizer filled into the model's, and the
        suffix drafter's depth caps and trie depth for vLLM (``VLLM_SUFFIX_SPEC_FACTOR``,
        ``VLLM_SUFFIX_FREE_SPEC_FACTOR``, ``VLLM_SUFFIX_MAX_DEPTH``) unless given."""
        opts = {k: dict(v) for k, v in self.drafter_options.items()}
        model = opts.setdefault("model", {})
        if self.draft_model:
            model.setdefault("path", self.draft_model)
        if target_tokenizer:
            model.setdefault("target_tokenizer", target_tokenizer)
        model.setdefault("shared_host", True)  # beside vLLM: no torch-OpenMP backends under backend=auto
        suffix = opts.setdefault("suffix", {})
        suffix.setdefault("max_spec_factor", VLLM_SUFFIX_SPEC_FACTOR)
        suffix.setdefault("free_spec_factor", VLLM_SUFFIX_FREE_SPEC_FACTOR)
        suffix.setdefault("max_depth", VLLM_SUFFIX_MAX_DEPTH)
        return opts

    @property
    def pad_mode(self) -> str:
        """pad_drafts as 'auto' | 'on' | 'off'."""
        return {True: "on", False: "off"}.get(self.pad_drafts, self.pad_drafts)  # type: ignore[arg-type]

    @property
    def narrow_width(self) -> int:
        """Draft slots of a narrow step (``narrow_slots``), 0 where narrow steps are off."""
        return self._usable_width(self.narrow_slots)

    @property
    def large_batch_width(self) -> int:
        """Draft slots of a narrow large-batch step (``large_batch_narrow_slots``), 0 where off."""
        return self._usable_width(self.large_batch_narrow_slots)

    @property
    def high_mat_width(self) -> int:
        """Draft slots of a mid-size narrow step while the MAT is high (``high_mat_narrow_slots``), 0 where off
        (also when ``narrow_slots`` is)."""
        return self._usable_width(self.high_mat_narrow_slots) if self.narrow_width else 0

    @property
    def narrow_widths(self) -> tuple[int, ...]:
        """Every width a narrow step may have (each gets its own full CUDA graphs: ``graphs.py``)."""
        widths = (self.narrow_width, self.high_mat_width, self.large_batch_width)
        return tuple(sorted({w for w in widths if w}))

    def _usable_width(self, w: int) -> int:
        return usable_width(w, self.num_speculative_tokens) if self.draft_slots == "adaptive" else 0

    def validate(self, *, where: str = "") -> None:
        super().validate(where=where)
        if self.pad_drafts not in PAD_CHOICES:
            raise ConfigError(f"{where}pad_drafts={self.pad_drafts!r} must be one of 'auto', 'on', 'off' (or true/false)")
        if not isinstance(self.drafter, (str, list, tuple, dict)):
            raise ConfigError(f"{where}drafter={self.drafter!r} must be a name, a dict with 'name', or a list")

def estimate_params(hf_config: Any) -> float:
    """Parameter count of a decoder-only transformer from its Hugging Face config (0.0 if the fields are missing).

    Per layer: attention q/o (2 h^2) + k/v (2 h x kv_heads x head_dim) + gated MLP (3 h x i); plus embeddings
    (and the LM head unless tied).
    Only an estimate, for pad_drafts="auto" and async_mode="auto" (MoE and exotic layouts count as dense).
    """
    text = getattr(hf_config, "text_config", None) or hf_config
    try:
        h = int(text.hidden_size)
        layers = int(text.num_hidden_layers)
        inter = int(getattr(text, "intermediate_size", 4 * h))
        heads = int(getattr(text, "num_attention_heads", 1))
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or h // heads)
        vocab = int(getattr(text, "vocab_size", 0))
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return 0.0
    per_layer = 2 * h * h + 2 * h * kv * head_dim + 3 * h * inter
    embeddings = vocab * h * (1 if getattr(text, "tie_word_embeddings", False) else 2)  # + untied LM head
    return float(layers * per_layer + embeddings)


def resolve_lane_threads(threads: int, *, schedule: bool) -> int:
    """``lane_threads`` with 0 ("auto") decided: ``SCHEDULE_LANE_THREADS`` in schedule mode, else 1."""
    if threads > 0:
        return threads
    return SCHEDULE_LANE_THREADS if schedule else 1


def resolve_async_mode(mode: str, *, params: float, tp: int = 1, pp: int = 1) -> str:
    """``mode`` with "auto" decided: "schedule" for a target of at least ``AUTO_SCHEDULE_MIN_PARAMS`` parameters
    on one GPU (schedule mode needs TP = PP = 1), else "thread". Other modes are returned unchanged."""
    if mode != "auto":
        return mode
    return "schedule" if params >= AUTO_SCHEDULE_MIN_PARAMS and (tp, pp) == (1, 1) else "thread"


def async_mode_for(mode: str, vllm_config: Any) -> str:
    """``resolve_async_mode`` for a vLLM config: its target's estimated size, its TP and PP sizes."""
    par = getattr(vllm_config, "parallel_config", None)
    params = estimate_params(getattr(getattr(vllm_config, "model_config", None), "hf_config", None))
    return resolve_async_mode(mode, params=params, tp=getattr(par, "tensor_parallel_size", 1),
                              pp=getattr(par, "pipeline_parallel_size", 1))


def normalise_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """kebab-case -> snake_case and the ``async`` alias."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        out[KEY_ALIASES.get(k, k)] = value
    return out


def split_speculative_config(spec: Mapping[str, Any]) -> tuple[dict[str, Any], SpecdecOptions]:
    """Split a ``{"method": "specdec", ...}`` dict into (vLLM's keys in custom_class form, our options).

    Unknown keys (neither vLLM's passthrough keys nor ours) raise ``ConfigError`` naming them and the valid ones.
    """
    data = normalise_keys(spec)
    method = data.get("method")
    if method != METHOD:
        raise ConfigError(f"method={method!r}: split_speculative_config handles method={METHOD!r} only")
    ours = {k: v for k, v in data.items() if k not in VLLM_KEYS}
    theirs = {k: v for k, v in data.items() if k in VLLM_KEYS}
    if "model" in theirs and theirs["model"] not in (None, PROPOSER_PATH):
        raise ConfigError(
            f"model={theirs['model']!r} is not used with method={METHOD!r}: choose the drafter with "
            f"'drafter' (e.g. 'suffix', 'model') and the draft model with 'draft_model': PATH"
        )
    k = theirs.get("num_speculative_tokens", SpecdecOptions.num_speculative_tokens)
    try:
        options = SpecdecOptions.from_dict({**ours, "num_speculative_tokens": k}, where="speculative_config: ")
    except ConfigError as exc:
        valid = sorted(set(SpecdecOptions.__dataclass_fields__) | VLLM_KEYS | set(KEY_ALIASES))
        msg = str(exc)
        if "unknown key" in msg:
            msg = msg.split("; valid keys")[0] + f"; valid keys with method={METHOD!r}: {', '.join(valid)}"
        raise ConfigError(msg) from None
    theirs.update(method="custom_class", model=PROPOSER_PATH, num_speculative_tokens=options.num_speculative_tokens)
    return theirs, options


def options_from_vllm_config(vllm_config: Any) -> SpecdecOptions:
    """Our options from ``vllm_config.additional_config["specdec"]`` (set by the rewrite, or by hand with the
    plain custom_class form); ``num_speculative_tokens`` always comes from vLLM's speculative config."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    ours = dict(extra.get(ADDITIONAL_CONFIG_KEY, {}) or {}) if isinstance(extra, Mapping) else {}
    ours = normalise_keys(ours)
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None)
    if k:
        ours["num_speculative_tokens"] = int(k)
    return SpecdecOptions.from_dict(ours, where="additional_config['specdec']: ")


def preset_json(name_or_path: str) -> str:
    """The ``--speculative-config`` JSON of a YAML preset (``configs/vllm_specdec.yaml``), validated."""
    import json

    from specdec.config import load_yaml

    data = load_yaml(name_or_path)
    split_speculative_config(data)  # raises ConfigError naming a bad key
    return json.dumps(data)


if __name__ == "__main__":
    import sys

    print(preset_json(sys.argv[1] if len(sys.argv) > 1 else "vllm_specdec"))
