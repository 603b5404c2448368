"""The built-in workload of ``specdec-eval`` with no data arguments: small, deterministic, generated here.

Three trace sets, generated from a fixed seed (same text on every machine), tokenized with the shared target's
tokenizer when it is present and with UTF-8 bytes otherwise (no ../shared needed):

* ``embedded_agent``  an agent episode per task: each call's prompt is the whole conversation so far (system
                      prompt, a source file, earlier tool calls and observations); the response edits the file,
                      re-quoting long spans of it (the copy-heavy, SuffixDecoding-friendly case).
* ``embedded_code``   code completion: a signature + docstring prompt, a templated body; identifiers and idioms
                      recur across records (a cross-request suffix cache helps, prompt lookup less).
* ``embedded_chat``   short free-text answers from a word grammar: little repetition (a low-acceptance floor).

Sizes are chosen so that the default run (suffix and ngram drafters) ends in well under a minute on 2 cores.
"""

from __future__ import annotations

import random
from typing import Any

from specdec.eval.records import TraceRecord
from specdec.eval.tokenization import TextTokenizer, encode_messages, load_tokenizer

SEED = 20261122
AGENT_TASKS = 6
AGENT_CALLS = 5
CODE_RECORDS = 40
CHAT_RECORDS = 30

_NOUNS = ["user", "record", "item", "buffer", "token", "node", "request", "config", "path", "value", "entry", "cache"]
_VERBS = ["load", "parse", "update", "build", "check", "merge", "split", "encode", "find", "render", "flush", "read"]
_TYPES = ["int", "str", "list[int]", "dict[str, int]", "bytes", "float"]
_WORDS = [
    "the",
    "a",
    "model",
    "system",
    "answer",
    "question",
    "because",
    "however",
    "many",
    "small",
    "large",
    "quickly",
    "often",
    "data",
    "result",
    "people",
    "time",
    "world",
    "example",
    "reason",
    "simple",
    "clear",
    "first",
    "second",
    "next",
    "finally",
    "also",
    "more",
    "less",
    "very",
    "important",
    "useful",
    "different",
    "common",
    "general",
    "specific",
    "possible",
    "likely",
]


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _function(rng: random.Random, name: str) -> tuple[str, str]:
    """(signature + docstring, body) of a templated Python function."""
    arg, typ = rng.choice(_NOUNS), rng.choice(_TYPES)
    head = (
        f"def {name}({arg}: {typ}, limit: int = {rng.randint(1, 64)}) -> {rng.choice(_TYPES)}:\n"
        f'    """{name.replace("_", " ").capitalize()} for each {arg} up to limit."""\n'
    )
    lines = [
        "    result = []",
        f"    for index, {arg}_item in enumerate({arg}):",
        "        if index >= limit:",
        "            break",
    ]
    for _ in range(rng.randint(2, 5)):
        other = _ident(rng)
        lines.append(f"        {arg}_item = {other}({arg}_item, index)")
    lines += [f"        result.append({arg}_item)", "    return result", ""]
    return head, "\n".join(lines) + "\n"


def _source_file(rng: random.Random, n_funcs: int) -> str:
    return "".join(h + b + "\n" for h, b in (_function(rng, _ident(rng)) for _ in range(n_funcs)))


def _agent_records(rng: random.Random, tok: TextTokenizer) -> list[TraceRecord]:
    records = []
    for task in range(AGENT_TASKS):
        path = f"src/{rng.choice(_NOUNS)}_{task}.py"
        source = _source_file(rng, 4)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent. Use the tools to edit files."},
            {"role": "user", "content": f"Fix the bug in {path}.\n<file path={path}>\n{source}</file>"},
        ]
        for call in range(AGENT_CALLS):
            lines = source.split("\n")
            lo = rng.randrange(0, max(1, len(lines) - 8))
            old = "\n".join(lines[lo : lo + 6])
            new = old.replace("index", "position") if call % 2 == 0 else old.replace("limit", "max_items")
            response = (
                f"I will update the loop in {path}.\n<function=str_replace_editor>\n"
                f"<parameter=command>str_replace</parameter>\n<parameter=path>{path}</parameter>\n"
                f"<parameter=old_str>{old}</parameter>\n<parameter=new_str>{new}</parameter>\n</function>"
            )
            prompt = encode_messages(tok, messages)
            records.append(TraceRecord(f"agent{task}/call{call}", prompt, tok.encode(response), f"agent{task}"))
            source = source.replace(old, new)
            messages += [
                {"role": "assistant", "content": response},
                {"role": "tool", "content": f"The file {path} has been edited:\n{new}\n"},
            ]
    return records


def _code_records(rng: random.Random, tok: TextTokenizer) -> list[TraceRecord]:
    out = []
    for i in range(CODE_RECORDS):
        head, body = _function(rng, _ident(rng))
        out.append(TraceRecord(f"code{i}", tok.encode(head), tok.encode(body)))
    return out


def _chat_records(rng: random.Random, tok: TextTokenizer) -> list[TraceRecord]:
    out = []
    for i in range(CHAT_RECORDS):
        q = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "?"
        sentences = [
            " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 16))).capitalize() + "."
            for _ in range(rng.randint(3, 7))
        ]
        out.append(TraceRecord(f"chat{i}", tok.encode(f"user: {q}\n"), tok.encode(" ".join(sentences))))
    return out


def embedded_traces(tokenizer: str | TextTokenizer | None = None) -> list[tuple[str, list[TraceRecord]]]:
    """[(dataset name, records)] of the built-in workload (deterministic for a given tokenizer)."""
    tok = load_tokenizer(tokenizer)
    return [
        ("embedded_agent", _agent_records(random.Random(SEED), tok)),
        ("embedded_code", _code_records(random.Random(SEED + 1), tok)),
        ("embedded_chat", _chat_records(random.Random(SEED + 2), tok)),
    ]


def embedded_tokenizer_name(tokenizer: str | TextTokenizer | None = None) -> str:
    return load_tokenizer(tokenizer).name
