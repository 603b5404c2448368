"""The vLLM benchmark's method table (``bench_vllm --methods``: name -> speculative config), the speculative config
a method or a ``--variants`` entry runs with, and the load and lossless constants that its CLI, worker and driver
share."""

from __future__ import annotations

from typing import Any

# the suffix drafter's options for drafts of depth 0 (depth <= match length x 0): every piece of the plugin runs, no
# step verifies a draft; what the plugin itself costs a step, against no speculation on the same (V1) runner
NO_DRAFT_SUFFIX = {"max_spec_factor": 0.0, "free_spec_factor": 0.0}
METHODS: dict[str, dict[str, Any] | None] = {
    "nospec": None,
    "nospec-v1": None,  # no-spec on vLLM's V1 model runner, the runner every CPU-drafter method runs on
    # the same with vLLM's synchronous scheduling, which vLLM 0.26 imposes on every CPU drafter: the reference that
    # splits "GPU waiting" into what synchronous scheduling costs and what speculation adds (bench_vllm_report)
    "nospec-sync": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    # vLLM's own GPU n-gram drafter: the one model-free method vLLM runs with async scheduling
    "ngram-gpu": {"method": "ngram_gpu", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix"},  # ArcticInference 0.1.1 cache, vLLM's defaults (k = depth = 24)
    # the default configuration ("async": true; async_mode "auto": schedule mode for targets of 1e9+
    # parameters on one GPU, thread mode below) and the synchronous path
    "specdec": {"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 16},
    "specdec-sync": {"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 16, "async": False},
    "specdec-nodraft": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "drafter_options": {"suffix": NO_DRAFT_SUFFIX},
    },
    # async_mode "thread" ("specdec-async" keeps the name it had while thread mode was the default): the native
    # step on the suffix engine's own thread, GIL released, beside vLLM's update_from_output; stops and starts while
    # the GPU runs the step
    "specdec-async": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "thread",
    },
    "specdec-thread": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "thread",
    },
    # vLLM's async scheduling (the engine prepares step N+1 while the GPU runs step N; drafts filled just in time)
    "specdec-sched": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "schedule",
    },
    # vLLM's uniform k slots per request under async scheduling (draft_slots "adaptive", the default, reserves each
    # request only as many slots as its latest draft had tokens past the confidence cut)
    "specdec-sched-uniform": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "schedule",
        "draft_slots": "uniform",
    },
    # the same with k by batch size (vLLM's scheduler reserves k slots for every request under async scheduling)
    "specdec-sched-dyn": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "schedule",
        "num_speculative_tokens_per_batch_size": [[1, 16, 16], [17, 1024, 8]],
    },
    # a short k at large batches, where each verified draft token costs GPU time the long chains seldom return
    "specdec-sched-k2": {
        "method": "specdec",
        "drafter": "suffix",
        "num_speculative_tokens": 16,
        "async": True,
        "async_mode": "schedule",
        "num_speculative_tokens_per_batch_size": [[1, 16, 16], [17, 1024, 2]],
    },
    # the draft model on the host CPU: the native forward on 8 threads (half the GPU host's cores), named rather
    # than calibrated at engine start (backend=auto would also build and time ONNX Runtime and numpy)
    "specdec-hybrid": {
        "method": "specdec",
        "drafter": ["suffix", "model"],
        "num_speculative_tokens": 8,
        "async": False,
        "drafter_options": {"model": {"num_threads": 8, "backend": "native"}},
    },
    # k=4: each draft token is one model step
    "specdec-model": {
        "method": "specdec",
        "drafter": "model",
        "num_speculative_tokens": 4,
        "async": False,
        "drafter_options": {"model": {"num_threads": 8, "backend": "native"}},
    },
}
V1_REFERENCES = ("nospec-v1", "nospec-sync")  # no-spec engines forced onto the V1 model runner
LOADS = {"closed": ("closed",), "sustained": ("sustained",), "both": ("closed", "sustained")}  # --load -> engines
SUSTAINED_SET = "sus"  # prompts file: "sus{b}" = the sustained set of concurrency b; results: its cell's key
LOSSLESS_BATCHES = (1, 8, 64)
LOSSLESS_MAX_TOKENS = 128


def _spec_config(
    method: str, override: dict[str, Any], variants: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """The speculative config of a method or of a ``--variants`` entry ({"base": method, "spec": {...}})."""
    variant = (variants or {}).get(method)
    if variant is not None:
        base_cfg = _spec_config(variant.get("base", "specdec"), override)
        return None if base_cfg is None else {**base_cfg, **variant.get("spec", {})}
    base = METHODS[method]
    if base is None:
        return None
    return {**base, **override} if method.startswith("specdec") else dict(base)
