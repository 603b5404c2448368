"""``specdec-eval``'s flags, checked before any work: each answer is one line and exit status 2.

* ``OneLineParser``: argparse's own errors (``--limit 1.5``, an unknown flag) as one line, not usage + error; a
  flag given twice (argparse keeps the last silently) is refused, except the repeatable ones (``--option``,
  ``--grid``);
* ``check_flags``: counts and times by the one rule for numbers (``specdec.config.check_number``: right type,
  finite, in range), ``--threads`` against this machine, ``--device`` against this torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from specdec.config import check_number

EXIT_USAGE = 2
REPEATABLE = (argparse._AppendAction, argparse._CountAction, argparse._HelpAction, argparse._VersionAction)
# (attribute, kind, lowest value, highest value, what to pass instead): the counts and times of every subcommand
COUNTS = (
    ("limit", int, 1, None, "omit --limit for all"),
    ("batch_size", int, 1, 65_536, ""),
    ("offset", int, 0, None, ""),
    ("max_new_tokens", int, 1, 1_000_000, ""),
    ("threads", int, 0, None, "0 = torch's default"),
    ("max_seconds", float, 0.0, 7 * 86_400.0, "0 = no limit"),
)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``specdec-eval: error: ...``, exit 2) and which refuses a flag
    given twice (``--budget 8 --budget 16`` ran 16 only)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"specdec-eval: error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        self._refuse_repeats(list(sys.argv[1:] if args is None else args))
        return super().parse_known_args(args, namespace)

    def _refuse_repeats(self, args: list[str]) -> None:
        """A flag of this parser (not a repeatable one) given twice is an error naming it."""
        seen: dict[int, str] = {}
        for tok in args:
            if tok == "--":
                break
            if not tok.startswith("-") or tok == "-":
                continue
            if not tok.startswith("--") and len(tok) > 2:  # "-x5" is -x with its value
                tok = tok[:2]
            action = self._action_for(tok.split("=", 1)[0])
            if action is None or isinstance(action, REPEATABLE):
                continue
            if id(action) in seen:
                flag = "/".join(action.option_strings)
                both = f" ({seen[id(action)]} and {tok})" if seen[id(action)] != tok else ""
                values = " with all its values" if action.nargs in ("+", "*") else ""
                self.error(f"{flag} is given twice{both}; argparse would keep only the last: give it once{values}")
            seen[id(action)] = tok

    def _action_for(self, name: str) -> argparse.Action | None:
        """This parser's optional action for ``name`` (an exact flag or an unambiguous prefix of one)."""
        exact = self._option_string_actions.get(name)
        if exact is not None or not name.startswith("--"):
            return exact
        hits = {id(a): a for flag, a in self._option_string_actions.items() if flag.startswith(name)}
        return next(iter(hits.values())) if len(hits) == 1 else None


def check_flags(args: argparse.Namespace) -> None:
    """Counts and times in range (``--limit 0`` is an error, not "all"), ``--threads`` against this machine and
    ``--device`` against this torch, before anything is loaded; ``ConfigError`` naming the flag otherwise."""
    for key, kind, lo, hi, hint in COUNTS:
        value = getattr(args, key, None)
        if value is not None:
            flag = "--" + key.replace("_", "-")
            setattr(args, key, check_number(flag, value, kind=kind, lo=lo, hi=hi, hint=hint))
    if getattr(args, "threads", None):
        from specdec.drafters.cpu_info import check_threads

        check_threads(args.threads, key="--threads")
    if getattr(args, "device", None) is not None:
        from specdec.device import check_device

        check_device(args.device, key="--device")
