"""The library's inputs, checked before any forward pass: prompts as token ids, the numbers of a ``generate`` call,
and prompts against the target's positions. Nothing is guessed: what is refused says what to pass instead.

* prompts: a string (with ``tokenizer=``), a list / 1-D array / tensor of int token ids, or a list of those; bytes,
  float or bool ids and negative ids are refused (``TypeError`` / ``ValueError`` naming the prompt and the id);
* ``max_new_tokens``: an int >= 0; ``eos_token_id``: None or an int in the target's vocabulary;
* a prompt whose tokens plus the new ones need more positions than the target has (``max_position_embeddings``):
  ``ConfigError`` naming its length, the limit and the flag that keeps its last tokens (``fit_positions``; the
  library's ``truncate_prompts=True``, ``specdec-eval live --truncate-prompts``).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from specdec.config import ConfigError, check_number

MAX_NEW_TOKENS = 1_000_000  # GenerateConfig's range of max_new_tokens
TRUNCATE_KWARG = "truncate_prompts=True"  # the library's flag that keeps a long prompt's last tokens
BINARY = (bytes, bytearray, memoryview)


def as_prompt_list(prompts: Any) -> list[Any]:
    """A bare string or a flat list of token ids is one prompt, not one prompt per character or id."""
    if isinstance(prompts, BINARY):
        raise TypeError(_bytes_message("prompts", prompts))
    if isinstance(prompts, str):
        return [prompts]
    if getattr(prompts, "ndim", None) == 1:  # a 1-D array or tensor of ids
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, numbers.Number) for p in items):  # ids (floats among them are refused later)
        return [items]
    return items


def _bytes_message(what: str, value: Any) -> str:
    head = bytes(value[:12])
    return (
        f"{what} is bytes ({head!r}...), not text or token ids: decode it (data.decode('utf-8')) and pass "
        "tokenizer=..., or pass list(data) for byte-level token ids"
    )


def prompt_ids(i: int, prompt: Any) -> list[int]:
    """``prompts[i]`` as a list of int token ids >= 0; anything else is refused naming the prompt and the id."""
    if isinstance(prompt, BINARY):
        raise TypeError(_bytes_message(f"prompts[{i}]", prompt))
    items = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    for j, t in enumerate(items):
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise TypeError(
                f"prompts[{i}][{j}]={t!r} is not a token id: token ids are ints >= 0 (convert them with int() "
                "if they are whole numbers, or pass text with tokenizer=...)"
            )
        if t < 0:
            raise ValueError(f"prompts[{i}][{j}]={t!r} is a negative token id: token ids are ints >= 0")
    return [int(t) for t in items]


def encode_prompts(prompts: Any, tokenizer: Any) -> list[list[int]]:
    """Every prompt as token ids: strings through ``tokenizer``, ids checked (``prompt_ids``)."""
    out = []
    for i, p in enumerate(as_prompt_list(prompts)):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is a string: pass tokenizer=... or give token ids")
            out.append(list(tokenizer(p)["input_ids"]))
        else:
            out.append(prompt_ids(i, p))
    return out


def check_call(max_new_tokens: Any, eos_token_id: Any, *, vocab_size: int) -> tuple[int, int | None]:
    """``generate``'s numbers: ``max_new_tokens`` an int in [0, 1e6], ``eos_token_id`` None or an id of the
    vocabulary; ``ConfigError`` naming the key, the value and the range otherwise."""
    n = check_number("max_new_tokens", max_new_tokens, kind=int, lo=0, hi=MAX_NEW_TOKENS, hint="a count of tokens")
    if eos_token_id is None:
        return n, None
    eos = check_number(
        "eos_token_id", eos_token_id, kind=int, lo=0, hi=vocab_size - 1, hint="pass None to never stop early"
    )
    return n, eos


def model_positions(model: Any) -> int | None:
    """The positions a Hugging Face model was built for (``config.max_position_embeddings``), None if unknown."""
    n = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(n) if isinstance(n, numbers.Integral) and n > 0 else None


def fit_positions(
    prompts: Sequence[list[int]],
    *,
    positions: int | None,
    max_new_tokens: int,
    truncate: bool,
    names: Sequence[str] | None = None,
    flags: tuple[str, str] = (TRUNCATE_KWARG, "max_new_tokens="),
) -> list[list[int]]:
    """``prompts`` whose tokens plus ``max_new_tokens`` fit the target's ``positions``; with ``truncate`` a longer one
    keeps its last tokens, else ``ConfigError`` naming the prompt, its length, the limit and the flag that truncates
    (``flags``: that flag and the new-token flag with its separator, as the caller's users write them)."""
    if positions is None:
        return list(prompts)
    truncate_flag, new_flag = flags
    room = positions - max_new_tokens
    if room < 1:
        raise ConfigError(
            f"{new_flag}{max_new_tokens} leaves no room for a prompt in the target's {positions} positions "
            f"(max_position_embeddings): ask at most {positions - 1} new tokens"
        )
    out = []
    for i, p in enumerate(prompts):
        if len(p) <= room:
            out.append(p)
        elif truncate:
            out.append(p[-room:])
        else:
            name = names[i] if names else f"prompts[{i}]"
            fewer = ", or ask fewer new tokens" if len(p) < positions else ""
            raise ConfigError(
                f"{name} has {len(p)} tokens; with {new_flag}{max_new_tokens} it needs {len(p) + max_new_tokens} "
                f"positions, more than the target's {positions} (max_position_embeddings): pass {truncate_flag} "
                f"to keep its last {room} tokens{fewer}"
            )
    return out


def default_eos(tokenizer: Any, model: Any) -> int | None:
    """The tokenizer's EOS id, else the model's generation config's (the first of a list), else None."""
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    if eos is None:
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return int(eos) if eos is not None else None
