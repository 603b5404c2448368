"""Rewrite ``{"method": "specdec", ...}`` into vLLM's ``custom_class`` form, inside vLLM's engine-args path.

vLLM's ``SpeculativeConfig.method`` is a closed Literal and unknown keys are forbidden, so the plugin wraps
``EngineArgs.create_speculative_config`` (``wrap_create``, a row of ``patches.table``):

    {"method": "specdec", "drafter": "suffix", "num_speculative_tokens": 16, "draft_timeout_ms": 20}
becomes
    speculative_config = {"method": "custom_class", "model": "specdec.vllm_plugin.proposer.SpecdecProposer",
                          "num_speculative_tokens": 16}
    additional_config["specdec"] = {"drafter": "suffix", "draft_timeout_ms": 20.0, ...}   # validated options

Validation (``entry.validation``) runs here, so a bad option stops ``vllm serve`` before any weight is loaded.

Pipeline parallelism (PP > 1) is served without speculation, said once: vLLM 0.26-0.33's model runner builds its
drafter on the last pipeline stage only and reads it on every stage when it builds attention metadata, so any
speculative method stops the first step of the other stages (measured with vLLM 0.26 at PP = 2).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from specdec.config import ConfigError
from specdec.vllm_plugin.entry.options import ADDITIONAL_CONFIG_KEY, METHOD, split_speculative_config
from specdec.vllm_plugin.entry.validation import validate_for_serving
from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.patches.common import is_wrapped, mark

logger = logging.getLogger(LOGGER_NAME)

DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default when the user sets none (the value is filled in after our hook)
AUTO_CUDAGRAPH_MAX_TOKENS = 2048  # cap of the automatic capture-size raise (capture time and memory)
AUTO_CUDAGRAPH_MAX_REQUESTS = 64  # the raise covers verify batches of up to this many requests with k drafts each:
# vLLM's default max_num_seqs (256-1024) would capture hundreds of graphs (start-up time) for batches whose
# drafts the adaptive slots narrow anyway
VLLM_DEFAULT_CAPTURE_TOKENS = 512  # vLLM's own cap on the default capture size
UNSAFE_CUDAGRAPH_MODE = "FULL"  # vLLM CUDAGraphMode that replays mixed verify batches from full graphs
SAFE_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"  # vLLM's default: full graphs for uniform batches only


def rewrite_engine_args(engine_args: Any) -> bool:
    """Rewrite ``engine_args.speculative_config`` in place if it asks for ``method="specdec"``.

    Returns True when rewritten. Raises ``ConfigError`` (a ValueError) naming a bad option and the valid ones.
    """
    spec = getattr(engine_args, "speculative_config", None)
    if getattr(engine_args, "spec_method", None) == METHOD:  # vLLM 0.32's --spec-method/--spec-tokens aliases
        spec = dict(spec or {}, method=METHOD)
        engine_args.spec_method = None
        if getattr(engine_args, "spec_tokens", None) is not None:
            spec["num_speculative_tokens"] = engine_args.spec_tokens
            engine_args.spec_tokens = None
    if not isinstance(spec, dict) or spec.get("method") != METHOD:  # no key normalised: another method's business
        return False
    theirs, options = split_speculative_config(spec)
    served = getattr(engine_args, "tokenizer", None) or getattr(engine_args, "model", None) or ""
    validate_for_serving(options, served=str(served))
    pp = getattr(engine_args, "pipeline_parallel_size", 1)
    if isinstance(pp, int) and pp > 1:
        logger.warning(
            "specdec: pipeline_parallel_size=%d: vLLM's model runner builds a drafter on the last pipeline stage "
            "only and reads it on every stage, so speculative decoding cannot run; serving without speculation "
            "(use tensor parallelism for specdec)",
            pp,
        )
        engine_args.speculative_config = None
        return False
    extra = getattr(engine_args, "additional_config", None)
    extra = dict(extra) if isinstance(extra, dict) else {}
    given = extra.get(ADDITIONAL_CONFIG_KEY)
    if given is not None and given != options.user_dict():
        raise ConfigError(
            f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is set and the speculative config has "
            f"method={METHOD!r}: give the options in one place only"
        )
    extra[ADDITIONAL_CONFIG_KEY] = options.user_dict()
    engine_args.speculative_config = theirs
    engine_args.additional_config = extra
    raise_cudagraph_capture(engine_args, options.cudagraph_max_tokens, options.num_speculative_tokens)
    guard_full_cudagraphs(engine_args)
    return True


def guard_full_cudagraphs(engine_args: Any) -> bool:
    """Replace a user's ``cudagraph_mode=FULL`` by FULL_AND_PIECEWISE (warned). Returns True if replaced.

    FULL also replays mixed batches (requests verifying different draft lengths) from full CUDA graphs captured
    for other batch shapes. With FlashAttention 3 that breaks speculative verification: the attention's launch
    choices captured in the graph are not those of the batch replayed, greedy outputs differ from no-spec and
    acceptance collapses, for vLLM's own ``ngram`` as for ours. Lossless output comes first.
    """
    cc = getattr(engine_args, "compilation_config", None)
    mode = cc.get("cudagraph_mode") if isinstance(cc, dict) else getattr(cc, "cudagraph_mode", None)
    if mode is None or getattr(mode, "name", str(mode)).upper() != UNSAFE_CUDAGRAPH_MODE:
        return False
    if isinstance(cc, dict):
        cc["cudagraph_mode"] = SAFE_CUDAGRAPH_MODE
    else:
        try:
            from vllm.config import CUDAGraphMode  # only reached inside vLLM's engine-args path

            cc.cudagraph_mode = CUDAGraphMode[SAFE_CUDAGRAPH_MODE]
        except (ImportError, KeyError) as exc:
            logger.warning("specdec: cudagraph_mode=FULL may change outputs and could not be replaced (%s)", exc)
            return False
    logger.warning(
        "specdec: cudagraph_mode=FULL changes speculative outputs on vLLM 0.26 (mixed verify batches "
        "in full CUDA graphs; measured for vLLM's ngram too): using %s instead",
        SAFE_CUDAGRAPH_MODE,
    )
    return True


def raise_cudagraph_capture(engine_args: Any, setting: int, k: int) -> int | None:
    """Let verify batches (up to max_num_seqs x (k+1) tokens) run in CUDA graphs.

    vLLM captures graphs up to ``min(max_num_seqs x (k+1) x 2, 512)`` tokens by default, so a batch of 64
    requests with k=16 drafts (1,088 tokens) runs eagerly. ``setting`` -1 raises the limit to
    min(max_num_seqs, ``AUTO_CUDAGRAPH_MAX_REQUESTS``) x (k+1), at most ``AUTO_CUDAGRAPH_MAX_TOKENS``; N sets N; 0
    leaves vLLM's default. A limit the user set (``max_cudagraph_capture_size`` or capture sizes, on the engine args or
    in ``compilation_config``) and ``enforce_eager`` always win. Returns the limit set, or None.
    """
    if setting == 0 or getattr(engine_args, "enforce_eager", False):
        return None
    cc = getattr(engine_args, "compilation_config", None)
    given = [
        getattr(engine_args, "max_cudagraph_capture_size", None),
        getattr(engine_args, "cudagraph_capture_sizes", None),
    ]
    given += [
        cc.get(key) if isinstance(cc, dict) else getattr(cc, key, None)
        for key in ("max_cudagraph_capture_size", "cudagraph_capture_sizes")
    ]
    if any(v is not None for v in given) or not hasattr(engine_args, "max_cudagraph_capture_size"):
        return None
    if setting < 0:
        seqs = min(getattr(engine_args, "max_num_seqs", None) or DEFAULT_MAX_NUM_SEQS, AUTO_CUDAGRAPH_MAX_REQUESTS)
        setting = min(int(seqs) * (k + 1), AUTO_CUDAGRAPH_MAX_TOKENS)
    if setting <= VLLM_DEFAULT_CAPTURE_TOKENS:
        return None
    engine_args.max_cudagraph_capture_size = setting
    return setting


def create_problem(engine_args_cls: Any) -> str:
    """'' if ``engine_args_cls`` has ``create_speculative_config``, else the reason."""
    fn = getattr(engine_args_cls, "create_speculative_config", None)
    return "" if callable(fn) else "no create_speculative_config"


def wrap_create(orig: Any, engine_args_cls: Any) -> Any:
    """``create_speculative_config`` (start): ``rewrite_engine_args`` first."""

    def create_speculative_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        rewrite_engine_args(self)
        return orig(self, *args, **kwargs)

    return create_speculative_config


def check_speculative_json(text: str, value: Any) -> None:
    """The checks of ``rewrite_engine_args`` that need no served model, on ``--speculative-config``'s text and value:
    no key given twice (JSON keeps the last), the options valid (``split_speculative_config``), the drafters and the
    draft model folder (``validate_for_serving``). Raises ``ConfigError``; other methods pass untouched."""
    if not isinstance(value, dict) or value.get("method") != METHOD:
        return

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise ConfigError(
                f"speculative_config: key {twice[0]!r} is given twice; JSON would keep the last: give it once"
            )
        return dict(pairs)

    json.loads(text, object_pairs_hook=unique)
    _, options = split_speculative_config(value)
    validate_for_serving(options)


def cli_args_problem(engine_args_cls: Any) -> str:
    """'' if ``engine_args_cls`` has ``add_cli_args``, else the reason."""
    return "" if callable(getattr(engine_args_cls, "add_cli_args", None)) else "no add_cli_args"


def wrap_cli_args(orig: Any, engine_args_cls: Any) -> Any:
    """``add_cli_args`` (a staticmethod; end): the ``--speculative-config`` argument it adds runs
    ``check_speculative_json`` as it is parsed: a bad option ends ``vllm serve`` in argparse's one error line (exit 2)
    instead of a traceback once the engine starts. vLLM loads general plugins (this one) just before it builds its
    parser."""

    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(parser, *args, **kwargs)
        for action in getattr(out if out is not None else parser, "_actions", []):
            if "--speculative-config" in action.option_strings and callable(action.type):
                action.type = _checked_type(action.type)
        return out

    return add_cli_args


def _checked_type(parse: Any) -> Any:
    """vLLM's ``--speculative-config`` type (JSON text -> dict) followed by ``check_speculative_json``."""
    if is_wrapped(parse, "speculative config (cli)"):
        return parse

    def checked(text: str) -> Any:
        value = parse(text)
        try:
            check_speculative_json(text, value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(" ".join(str(exc).split())) from None
        return value

    return mark(checked, "speculative config (cli)")
