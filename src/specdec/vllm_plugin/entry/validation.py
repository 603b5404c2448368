"""Checks of the options against the machine and the served model, at configuration time.

Run inside vLLM's engine-args path (``entry.rewrite.rewrite_engine_args``), so ``vllm serve`` exits with one line
naming the key, the value and the fix before any weight is loaded: unknown drafter names and bad per-drafter
options, a ``draft_model`` folder that does not exist, a draft model whose tokenizer differs from the served
model's (tokenizer files compared: vocabulary and special tokens; no weights read). Never imports vLLM.
"""

from __future__ import annotations

from pathlib import Path

from specdec.config import ConfigError
from specdec.drafters.model import check_tokenizer_compat
from specdec.drafters.registry import DRAFTER_NAMES, check_repeats, drafter_class, drafter_specs
from specdec.vllm_plugin.entry.options import SpecdecOptions

MODEL_DRAFTER = "model"  # the drafter that loads a draft model


def check_drafters(options: SpecdecOptions) -> list[str]:
    """The drafter names, each known and its options valid; raises ``ConfigError`` naming the bad one."""
    names, parts = [], []
    for name, own in drafter_specs(options.drafter):
        if name not in DRAFTER_NAMES:
            raise ConfigError(
                f"speculative_config: drafter={name!r} is unknown; use one of "
                f'{", ".join(DRAFTER_NAMES)} (e.g. "drafter": "suffix")'
            )
        merged = {**dict(options.resolved_drafter_options().get(name, {})), **own}
        if name == MODEL_DRAFTER:
            merged.pop("path", None)  # checked by check_draft_model
        drafter_class(name).Config.from_dict(merged, where=f"speculative_config: drafter_options[{name!r}]: ")
        names.append(name)
        parts.append((name, merged))
    check_repeats(parts, where="speculative_config: drafter")
    unused = sorted(set(options.drafter_options) - set(names))
    if unused:
        raise ConfigError(
            f"speculative_config: drafter_options has {', '.join(map(repr, unused))} but drafter="
            f"{options.drafter!r} does not use them: add them to 'drafter' or remove them"
        )
    return names


def check_draft_model(options: SpecdecOptions, *, served: str = "") -> str:
    """The draft model folder of a 'model' drafter ('' without one), which must exist and share the tokenizer of
    ``served`` (the served model's local folder; '' or a hub id: not compared). Raises ``ConfigError``."""
    names = [name for name, _ in drafter_specs(options.drafter)]
    path = options.draft_model or str(options.drafter_options.get(MODEL_DRAFTER, {}).get("path", ""))
    if MODEL_DRAFTER not in names:
        if options.draft_model:
            raise ConfigError(
                f"speculative_config: draft_model={options.draft_model!r} is set but drafter="
                f'{options.drafter!r} has no \'model\': add "drafter": ["suffix", "model"] or drop it'
            )
        return ""
    if not path:
        raise ConfigError(
            'speculative_config: drafter \'model\' needs "draft_model": "/path/to/draft" (a local '
            "model folder with config.json and the tokenizer files)"
        )
    if not Path(path).is_dir():
        raise ConfigError(
            f"speculative_config: draft_model={path!r} is not a folder: give the local folder of a "
            "draft model that shares the served model's tokenizer"
        )
    if served and Path(served).is_dir():
        try:
            check_tokenizer_compat(path, served)
        except ConfigError as exc:
            raise ConfigError(f"speculative_config: draft_model={path!r}: {exc}") from None
    return path


def validate_for_serving(options: SpecdecOptions, *, served: str = "") -> None:
    """Every configuration-time check of the options against this machine and the served model."""
    check_drafters(options)
    check_draft_model(options, served=served)
