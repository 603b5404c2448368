"""``CoreOptions``: what the drafting core reads of the user's options (``entry.options.SpecdecOptions`` has them),
named here so that ``core/`` never imports ``entry/``; the internal settings come apart, as
``internal.InternalSettings``."""

from __future__ import annotations

from typing import Any, Protocol


class CoreOptions(Protocol):
    """The user options the core, its policy, its reporting and the thread mode read (read-only)."""

    @property
    def drafter(self) -> Any: ...

    @property
    def num_speculative_tokens(self) -> int: ...

    @property
    def draft_timeout_ms(self) -> float: ...

    @property
    def adaptive(self) -> bool: ...

    @property
    def lane_threads(self) -> int: ...

    @property
    def strict(self) -> bool: ...

    @property
    def log_every_s(self) -> float: ...

    @property
    def pad_mode(self) -> str: ...
