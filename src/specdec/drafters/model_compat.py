"""Whether a draft model can draft for a target: the same tokenizer (strings to ids) when both folders hold one,
else the same vocabulary size. A mismatch is a ``ConfigError`` before any model is loaded.
"""

from __future__ import annotations

from pathlib import Path

from specdec.config import ConfigError


def _tokenizer_vocab(path: Path) -> dict[str, int]:
    tok_file = path / "tokenizer.json"
    if tok_file.exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tok_file)).get_vocab(with_added_tokens=True)
    from transformers import AutoTokenizer

    return dict(AutoTokenizer.from_pretrained(str(path)).get_vocab())


def check_tokenizer_compat(draft_path: str | Path, target_path: str | Path) -> None:
    """Raise ConfigError unless the draft and target tokenizers map the same strings to the same ids."""
    draft, target = _tokenizer_vocab(Path(draft_path)), _tokenizer_vocab(Path(target_path))
    if draft == target:
        return
    diff = sorted(k for k in set(draft) | set(target) if draft.get(k) != target.get(k))
    examples = ", ".join(f"{k!r}: draft {draft.get(k)} vs target {target.get(k)}" for k in diff[:3])
    raise ConfigError(
        f"draft model {str(draft_path)!r} and target {str(target_path)!r} use different tokenizers "
        f"({len(draft)} vs {len(target)} tokens, {len(diff)} differ, e.g. {examples}); "
        "a draft model must share the target's tokenizer: pick a draft model trained with it"
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).exists() for f in TOKENIZER_FILES)


def config_vocab_size(path: str | Path) -> int | None:
    """``vocab_size`` of a model folder's config.json (or its text_config), None when absent."""
    import json

    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        return None
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    size = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
    return int(size) if size is not None else None


def check_draft_target(
    draft_path: str | Path, *, target_dir: str | Path | None = None, target_vocab: int | None = None
) -> None:
    """Raise ConfigError unless the draft model can draft for the target: the same tokenizer when both folders
    hold one (embedding sizes may then differ by padding), else the same vocabulary size."""
    draft = Path(draft_path)
    if target_dir is not None and has_tokenizer(target_dir) and has_tokenizer(draft):
        check_tokenizer_compat(draft, target_dir)
        return
    draft_vocab = config_vocab_size(draft)
    if target_vocab is None and target_dir is not None:
        target_vocab = config_vocab_size(target_dir)
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        raise ConfigError(
            f"draft model {str(draft)!r} has a vocabulary of {draft_vocab} tokens, the target "
            f"{target_vocab}: a draft model must share the target's tokenizer (give the target's "
            "folder, with its tokenizer, to compare tokenizers instead of sizes)"
        )
