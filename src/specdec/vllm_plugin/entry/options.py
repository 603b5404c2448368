"""Typed, validated options of the vLLM plugin (the keys of ``--speculative-config`` beside vLLM's own).

    {"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 16, "draft_timeout_ms": 20}

``split_speculative_config`` separates a user's dict into the keys vLLM's ``SpeculativeConfig`` knows and ours;
``SpecdecOptions.from_dict`` validates ours (unknown key -> ``ConfigError`` naming it and the valid keys).
This module never imports vLLM (CPU tests and CI use it directly).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specdec.config import ConfigBase, ConfigError, load_yaml, rng

METHOD = "specdec"  # the friendly method name users write
PROPOSER_PATH = "specdec.vllm_plugin.proposer.SpecdecProposer"  # the custom_class it becomes
ADDITIONAL_CONFIG_KEY = "specdec"  # where our options travel: vllm_config.additional_config["specdec"]
MAX_SPEC_LEN = 128  # vLLM's rejection sampler limit on draft length

# Keys of vLLM's SpeculativeConfig that may appear beside ours in a "specdec" dict (passed through to vLLM).
VLLM_KEYS = frozenset(
    {
        "method",
        "model",
        "num_speculative_tokens",
        "enforce_eager",
        "draft_tensor_parallel_size",
        "disable_padded_drafter_batch",
        "num_speculative_tokens_per_batch_size",
        "rejection_sample_method",
        "draft_sample_method",
        "synthetic_acceptance_rates",
        "synthetic_acceptance_length",
        "max_model_len",
    }
)
PAD_CHOICES = ("auto", "on", "off", True, False)
SLOT_MODES = ("uniform", "adaptive")  # draft_slots (schedule mode's slot policy: modes/slots.py)
KEY_ALIASES = {"async": "async_drafting"}  # `async` is a Python keyword; users write "async": true
ASYNC_MODES = ("auto", "thread", "schedule")
AUTO_SCHEDULE_MIN_PARAMS = (
    1e9  # async_mode "auto": targets this large draft in "schedule" mode (one GPU), else "thread"
)
SCHEDULE_LANE_THREADS = 4  # lane_threads 0 ("auto") in schedule mode, where the GPU waits for the drafting
# suffix drafts at most their match length where verified tokens cost (large batches), at most 8x it where rows are
# padded to k anyway (padding makes the extra tokens free)
VLLM_SUFFIX_SPEC_FACTOR = 1.0
VLLM_SUFFIX_FREE_SPEC_FACTOR = 8.0
# suffix tries half as deep as the library's 64 beside vLLM: the engine thread's stops and the drafting the GPU waits
# for cost about a quarter less at batch 64, for a negligible loss of accepted tokens
VLLM_SUFFIX_MAX_DEPTH = 32
# calibrated suffix chains beside vLLM (#42; the native lane drafts them): 0, count / total chains. Gated at 0.06 with
# the per-step gate (6b866a2, eval/results/2026-11-28_h200x2_gate_6b866a2.json): fewer steps on agentic batches 8-32,
# more on code batches 1-8 and chat; off (branch h42-calib holds 0.06)
VLLM_SUFFIX_MIN_CONFIDENCE = 0.0
MAX_PORT = 65_535
DEFAULT_METRICS_HOST = "127.0.0.1"


@dataclass(frozen=True)
class SpecdecOptions(ConfigBase):
    """The user's options of the specdec proposer inside vLLM (snake_case keys of the speculative config;
    docs/options.md), nothing else: the internal settings, fixed in code, are ``internal.InternalSettings``."""

    drafter: Any = rng(
        "suffix", doc="drafter: 'suffix', 'ngram', 'model', {'name': ..., **options} or a list of them (each once)"
    )
    drafter_options: dict = rng({}, doc="per-drafter option dicts, e.g. {'suffix': {'max_depth': 32}}")
    draft_model: str = rng("", doc="the draft model folder for drafter 'model' (same tokenizer as the served model)")
    num_speculative_tokens: int = rng(16, lo=1, hi=MAX_SPEC_LEN, doc="most draft tokens per request and step (k)")
    async_drafting: bool = rng(True, doc="draft off vLLM's critical path (key 'async'); how: async_mode")
    async_mode: str = rng(
        "auto",
        choices=ASYNC_MODES,
        doc="'schedule': vLLM's async scheduling, the GPU waits for the drafts; 'thread': the "
        "drafter's own thread drafts while vLLM processes outputs; 'auto': 'schedule' for "
        "targets of at least 1e9 parameters or with tensor parallelism, else 'thread'",
    )
    draft_timeout_ms: float = rng(
        50.0, lo=0.0, hi=60_000.0, doc="per-step drafting deadline; past it the step gets no draft (0: none)"
    )
    draft_slots: str = rng(
        "adaptive",
        choices=SLOT_MODES,
        doc="schedule mode: 'adaptive' reserves each request the slots its latest draft can "
        "use (slot policy in modes/slots.py); 'uniform': k for every request",
    )
    narrow_graphs: bool = rng(
        True,
        doc="schedule mode with adaptive slots: mid-size and low-acceptance batches "
        "verify a uniform width, run as extra FULL CUDA graphs",
    )
    ragged_graphs: bool = rng(
        True,
        doc="schedule mode: verify batches of per-request lengths run as FULL CUDA "
        "graphs (where every attention backend supports them)",
    )
    pad_drafts: Any = rng(
        "auto",
        doc="'on': pad every draft to k (uniform batch, FULL CUDA graph); 'off'; 'auto': "
        "pad when the padded tokens cost under 10% of the step",
    )
    cudagraph_max_tokens: int = rng(
        -1,
        lo=-1,
        hi=1 << 16,
        doc="-1: raise vLLM's CUDA-graph capture limit to min(max_num_seqs, 64) x (k+1) "
        "(at most 2048) unless set; 0: vLLM's default; N: N tokens",
    )
    adaptive: bool = rng(True, doc="shorten drafts where they cannot pay (step-cost model, per-request acceptance)")
    lane_threads: int = rng(0, lo=0, hi=64, doc="threads drafting one step's rows (0: 4 in schedule mode, else 1)")
    strict: bool = rng(False, doc="re-raise drafter errors (debugging: a drafter failure then fails the engine)")
    log_every_s: float = rng(
        60.0,
        lo=0.0,
        hi=86_400.0,
        doc="log drafting statistics this often, their totals when the engine goes idle and once at exit (0: never)",
    )
    metrics_port: int = rng(
        0,
        lo=0,
        hi=MAX_PORT,
        doc="serve the plugin's counters in Prometheus text on http://metrics_host:PORT/metrics from the drafting "
        "process (data-parallel engine i: PORT + i); 0: off (docs/metrics.md)",
    )
    metrics_host: str = rng(
        DEFAULT_METRICS_HOST,
        doc="address the metrics endpoint binds: loopback by default, '0.0.0.0' for every interface",
    )

    def resolved_drafter_options(self, target_tokenizer: str = "") -> dict[str, dict[str, Any]]:
        """``drafter_options`` with ``draft_model`` and the served model's tokenizer filled into the model's, and the
        suffix drafter's depth caps and trie depth for vLLM (``VLLM_SUFFIX_SPEC_FACTOR``,
        ``VLLM_SUFFIX_FREE_SPEC_FACTOR``, ``VLLM_SUFFIX_MAX_DEPTH``, ``VLLM_SUFFIX_MIN_CONFIDENCE`` where > 0) unless
        given."""
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
        if VLLM_SUFFIX_MIN_CONFIDENCE > 0:
            suffix.setdefault("min_confidence", VLLM_SUFFIX_MIN_CONFIDENCE)
        return opts

    @property
    def pad_mode(self) -> str:
        """pad_drafts as 'auto' | 'on' | 'off'."""
        return {True: "on", False: "off"}.get(self.pad_drafts, self.pad_drafts)  # type: ignore[arg-type]

    def user_dict(self) -> dict[str, Any]:
        """The user options as a plain dict: what travels in ``additional_config``."""
        return self.to_dict()

    def validate(self, *, where: str = "") -> None:
        super().validate(where=where)
        if self.draft_model and not isinstance(self.draft_model, str):
            raise ConfigError(f"{where}draft_model={self.draft_model!r} must be a folder path (a string)")
        if self.pad_drafts not in PAD_CHOICES:
            raise ConfigError(
                f"{where}pad_drafts={self.pad_drafts!r} must be one of 'auto', 'on', 'off' (or true/false)"
            )
        check_drafter_shape(self.drafter, where=where)
        check_drafter_options_shape(self.drafter_options, where=where)
        try:
            ipaddress.ip_address(self.metrics_host)
        except ValueError:
            raise ConfigError(
                f"{where}metrics_host={self.metrics_host!r} is not an IP address: use '127.0.0.1' (this host only), "
                f"'0.0.0.0' (every interface) or one of this host's addresses"
            ) from None


DRAFTER_SHAPE = "a drafter name ('suffix'), a dict with 'name' ({'name': 'suffix', 'max_depth': 32}) or a list of those"


def check_drafter_shape(spec: Any, *, where: str = "") -> None:
    """``drafter`` is a non-empty name, a dict whose 'name' is one, or a non-empty list of those (docs/options.md);
    ``ConfigError`` naming the value and the shapes otherwise (an empty list passed and failed in the engine)."""
    parts = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    if not parts:
        raise ConfigError(f"{where}drafter={spec!r} names no drafter: give {DRAFTER_SHAPE}")
    for part in parts:
        name = part.get("name") if isinstance(part, Mapping) else part
        if not isinstance(name, str) or not name:
            got = f"drafter={spec!r}" if part is spec else f"drafter={spec!r} holds {part!r}"
            raise ConfigError(f"{where}{got}: give {DRAFTER_SHAPE}")


def check_drafter_options_shape(opts: Mapping[str, Any], *, where: str = "") -> None:
    """``drafter_options`` maps drafter names to option dicts (``{"suffix": {"max_depth": 32}}``); ``ConfigError``
    naming the entry otherwise (a number or a string there raised AttributeError in the engine)."""
    for name, own in opts.items():
        if not isinstance(name, str) or not isinstance(own, Mapping):
            raise ConfigError(
                f"{where}drafter_options[{name!r}]={own!r} must be a dict of that drafter's options, e.g. "
                "drafter_options={'suffix': {'max_depth': 32}}"
            )
        bad = [k for k in own if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"{where}drafter_options[{name!r}] has key {bad[0]!r}: option names are strings")


MAX_USER_OPTIONS = 20  # the house rule: at most ~20 user options
USER_KEYS = frozenset(SpecdecOptions.__dataclass_fields__)  # the user options
assert len(USER_KEYS) <= MAX_USER_OPTIONS


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
    or split by tensor parallelism (thread mode's drafts would keep vLLM from scheduling asynchronously there, as
    no speculation does), else "thread"; "thread" with PP > 1 (schedule mode needs PP = 1). Other modes are
    returned unchanged."""
    if mode != "auto":
        return mode
    return "schedule" if (params >= AUTO_SCHEDULE_MIN_PARAMS or tp > 1) and pp == 1 else "thread"


def async_mode_for(mode: str, vllm_config: Any) -> str:
    """``resolve_async_mode`` for a vLLM config: its target's estimated size, its TP and PP sizes."""
    par = getattr(vllm_config, "parallel_config", None)
    params = estimate_params(getattr(getattr(vllm_config, "model_config", None), "hf_config", None))
    return resolve_async_mode(
        mode, params=params, tp=getattr(par, "tensor_parallel_size", 1), pp=getattr(par, "pipeline_parallel_size", 1)
    )


def schedule_mode_for(options: SpecdecOptions, vllm_config: Any) -> bool:
    """The options draft under vLLM's async scheduling ("schedule" mode) on this config: ``async_drafting`` on and
    ``async_mode`` "schedule", or "auto" that ``async_mode_for`` resolves so."""
    return options.async_drafting and async_mode_for(options.async_mode, vllm_config) == "schedule"


def normalise_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """kebab-case -> snake_case and the ``async`` alias; two keys naming one option (``async`` and
    ``async_drafting``, ``draft-model`` and ``draft_model``) are a ``ConfigError`` naming both (one was dropped)."""
    out: dict[str, Any] = {}
    given: dict[str, Any] = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        k = KEY_ALIASES.get(k, k)
        if k in given:
            raise ConfigError(
                f"speculative_config: {given[k]!r} and {key!r} both set {k} ({out[k]!r} and {value!r}); give one"
            )
        given[k] = key
        out[k] = value
    return out


def check_user_keys(data: Mapping[str, Any], *, where: str, extra: frozenset[str] = frozenset()) -> None:
    """Raise ``ConfigError`` naming every key of ``data`` that is neither a user option nor in ``extra``, with the
    valid keys listed."""
    unknown = sorted(k for k in data if k not in USER_KEYS and k not in extra)
    if unknown:
        valid = sorted(USER_KEYS | extra | set(KEY_ALIASES))
        raise ConfigError(
            f"{where}unknown key(s) {', '.join(map(repr, unknown))} with method={METHOD!r}; valid "
            f"keys: {', '.join(valid)}"
        )


def split_speculative_config(spec: Mapping[str, Any]) -> tuple[dict[str, Any], SpecdecOptions]:
    """Split a ``{"method": "specdec", ...}`` dict into (vLLM's keys in custom_class form, our options).

    Unknown keys (neither vLLM's passthrough keys nor user options) raise ``ConfigError`` naming them and the valid
    ones; so do out-of-range values (naming the key, the value and the range)."""
    data = normalise_keys(spec)
    method = data.get("method")
    if method != METHOD:
        raise ConfigError(f"method={method!r}: split_speculative_config handles method={METHOD!r} only")
    check_user_keys(data, where="speculative_config: ", extra=VLLM_KEYS)
    ours = {k: v for k, v in data.items() if k not in VLLM_KEYS}
    theirs = {k: v for k, v in data.items() if k in VLLM_KEYS}
    if "model" in theirs and theirs["model"] not in (None, PROPOSER_PATH):
        raise ConfigError(
            f"model={theirs['model']!r} is not used with method={METHOD!r}: choose the drafter with "
            f"'drafter' (e.g. 'suffix', 'model') and the draft model with 'draft_model': PATH"
        )
    k = theirs.get("num_speculative_tokens", SpecdecOptions.num_speculative_tokens)
    options = SpecdecOptions.from_dict({**ours, "num_speculative_tokens": k}, where="speculative_config: ")
    theirs.update(method="custom_class", model=PROPOSER_PATH, num_speculative_tokens=options.num_speculative_tokens)
    return theirs, options


def options_from_vllm_config(vllm_config: Any) -> SpecdecOptions:
    """Our options from ``vllm_config.additional_config["specdec"]`` (set by the rewrite, or by hand with the
    plain custom_class form); ``num_speculative_tokens`` always comes from vLLM's speculative config."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    ours = dict(extra.get(ADDITIONAL_CONFIG_KEY, {}) or {}) if isinstance(extra, Mapping) else {}
    ours = normalise_keys(ours)
    where = f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]: "
    check_user_keys(ours, where=where)
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None)
    if k:
        ours["num_speculative_tokens"] = int(k)
    return SpecdecOptions.from_dict(ours, where=where)


def preset_json(name_or_path: str) -> str:
    """The ``--speculative-config`` JSON of a YAML preset (``configs/vllm_specdec.yaml``), validated."""
    data = load_yaml(name_or_path)
    split_speculative_config(data)  # raises ConfigError naming a bad key
    return json.dumps(data)


if __name__ == "__main__":
    import sys

    print(preset_json(sys.argv[1] if len(sys.argv) > 1 else "vllm_specdec"))
