"""Text -> token ids for trace replay: Hugging Face tokenizers, a byte-level fallback, chat rendering.

Rendering follows the anchors' recipe (``../shared/data/anchors_replay.py``): chat messages are flattened to
``"role: content\\n"`` one message at a time and each message is tokenized on its own (ids concatenated, so
multi-turn prompts that share earlier messages reuse cached ids); list-valued content keeps its text parts;
OpenAI-style tool calls render as ``<function=NAME>\\n<parameter=KEY>VALUE</parameter>\\n</function>``. No
special tokens are added.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from specdec.paths import TARGET_MODEL, model_path

BYTE_VOCAB = 256
_MSG_CACHE_MAX = 200_000  # distinct message strings kept per tokenizer


class TokenizerError(ValueError):
    """A tokenizer path is missing or unreadable (the message says what was expected)."""


class TextTokenizer:
    """Minimal tokenizer interface used by the loaders: ``encode``, ``decode``, ``vocab_size``, ``fingerprint``."""

    name: str = "tokenizer"
    vocab_size: int = 0
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """Stable id of the vocabulary and merges (keys the trace cache)."""
        return self.name

    def __init__(self) -> None:
        self._cache: dict[str, np.ndarray] = {}

    def encode_cached(self, text: str) -> np.ndarray:
        """[n] int32 ids of ``text``, memoised (chat messages repeat across the calls of one conversation)."""
        ids = self._cache.get(text)
        if ids is None:
            ids = np.asarray(self.encode(text), dtype=np.int32)
            if len(self._cache) >= _MSG_CACHE_MAX:
                self._cache.clear()
            self._cache[text] = ids
        return ids


class ByteTokenizer(TextTokenizer):
    """UTF-8 bytes as token ids (vocab 256): the fallback when no Hugging Face tokenizer is available."""

    name = "bytes"
    vocab_size = BYTE_VOCAB

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


NO_TOKENIZER = "none"


class NoTokenizer(TextTokenizer):
    """``--tokenizer none``: token-id traces replayed as they are (any vocabulary); text cannot be encoded."""

    name = NO_TOKENIZER
    vocab_size = 0  # unknown: ids are not checked against a vocabulary

    def encode(self, text: str) -> list[int]:
        raise TokenizerError(
            "this record is text but --tokenizer none was given; --tokenizer none is for "
            "token-id traces (prompt_ids/response_ids): pass a tokenizer folder or 'bytes'"
        )

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


class HFTokenizer(TextTokenizer):
    """A local Hugging Face tokenizer folder. Uses ``tokenizers`` directly when ``tokenizer.json`` exists (fast
    to load, same ids as ``AutoTokenizer(..., add_special_tokens=False)``), else ``transformers.AutoTokenizer``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise TokenizerError(
                f"--tokenizer {str(path)!r}: no such folder; expected a local Hugging Face "
                f"tokenizer folder (with tokenizer.json), e.g. ../shared/models/{TARGET_MODEL}"
            )
        self.name = str(self.path.resolve())
        self._fast = None
        self._hf = None
        tj = self.path / "tokenizer.json"
        if tj.exists():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(tj))
            self.vocab_size = int(self._fast.get_vocab_size(with_added_tokens=True))
        else:
            try:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(self.path))
            except Exception as exc:  # noqa: BLE001 - report any load failure as one line
                raise TokenizerError(
                    f"--tokenizer {str(path)!r}: cannot load a Hugging Face tokenizer ({exc})"
                ) from exc
            self.vocab_size = len(self._hf)
        self.eos_token_id = self._read_eos()

    def _read_eos(self) -> int | None:
        cfg = self.path / "tokenizer_config.json"
        if not cfg.exists() or self._fast is None:
            return getattr(self._hf, "eos_token_id", None) if self._hf is not None else None
        tok = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        return self._fast.token_to_id(tok) if isinstance(tok, str) else None

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._hf(text, add_special_tokens=False)["input_ids"]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        if self._fast is not None:
            return self._fast.decode([int(i) for i in ids], skip_special_tokens=False)
        return self._hf.decode(list(ids))

    @property
    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for fname in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model"):
            p = self.path / fname
            if p.exists():
                h.update(fname.encode() + b"\0" + p.read_bytes())
        return "hf:" + h.hexdigest()[:24]


def default_tokenizer_path() -> Path:
    return model_path(TARGET_MODEL)


def describe_tokenizer(spec: str | os.PathLike[str] | None) -> dict[str, str]:
    """What ``--tokenizer`` ``spec`` tokenizes with: ``name`` (short, for table titles), ``path`` and ``why`` (the
    default is the shared target's tokenizer where ../shared has it, else UTF-8 bytes: numbers differ between them)."""
    if spec is None:
        path = default_tokenizer_path()
        if (path / "tokenizer.json").exists():
            return {"name": path.name, "path": str(path), "why": "default: the shared target's tokenizer"}
        return {"name": "bytes", "path": "", "why": f"default: UTF-8 bytes, no shared tokenizer at {path}"}
    if str(spec) in (ByteTokenizer.name, NO_TOKENIZER):
        return {"name": str(spec), "path": "", "why": "--tokenizer"}
    return {"name": Path(spec).name or str(spec), "path": str(spec), "why": "--tokenizer"}


def load_tokenizer(spec: str | os.PathLike[str] | TextTokenizer | None = None) -> TextTokenizer:
    """``None`` -> the shared target's tokenizer if present, else bytes; ``"bytes"`` -> bytes; ``"none"`` -> no
    tokenizer (token-id traces only); else a folder."""
    if isinstance(spec, TextTokenizer):
        return spec
    if str(spec) == NO_TOKENIZER:
        return NoTokenizer()
    if spec is None:
        path = default_tokenizer_path()
        return HFTokenizer(path) if (path / "tokenizer.json").exists() else ByteTokenizer()
    if str(spec) == ByteTokenizer.name:
        return ByteTokenizer()
    return HFTokenizer(spec)


# ------------------------------------------------------------------------------------------- chat rendering
def content_text(content: Any) -> str:
    """Text of a message's content: a string, a list of parts (text parts kept, in order), or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                parts.append(str(part))
            elif "text" in part:
                parts.append(str(part["text"]))
        return "".join(parts)
    return str(content)


def _render_call(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    raw = fn.get("arguments", "")
    try:
        args = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError:
        args = None
    lines = [f"<function={fn.get('name', '')}>"]
    if isinstance(args, dict):
        lines += [f"<parameter={k}>{v if isinstance(v, str) else json.dumps(v)}</parameter>" for k, v in args.items()]
    else:
        lines.append(str(raw))
    lines.append("</function>")
    return "\n".join(lines)


def render_tool_calls(calls: Iterable[dict[str, Any]] | None) -> str:
    """Tool calls as plain text (argument values raw, not JSON-escaped), one block per call."""
    return "\n".join(_render_call(c) for c in (calls or []))


def join_content_and_calls(content: Any, calls: Iterable[dict[str, Any]] | None) -> str:
    text = content_text(content)
    rendered = render_tool_calls(calls)
    return f"{text}\n{rendered}" if (text and rendered) else (text or rendered)


def message_text(message: dict[str, Any]) -> str:
    """One flattened message: ``"role: content\\n"`` (assistant tool calls follow the content)."""
    return f"{message.get('role', '')}: {join_content_and_calls(message.get('content'), message.get('tool_calls'))}\n"


def encode_messages(tok: TextTokenizer, messages: Sequence[dict[str, Any] | str]) -> np.ndarray:
    """[n] int32: each message rendered and tokenized alone (cached), ids concatenated."""
    parts = [tok.encode_cached(m if isinstance(m, str) else message_text(m)) for m in messages]
    return np.concatenate(parts).astype(np.int32, copy=False) if parts else np.zeros(0, np.int32)
