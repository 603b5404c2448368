"""The vLLM releases the plugin is tested against, and the span of releases it supports.

This module is the one place that lists them: ``scripts/test.sh`` reads ``TESTED_VLLM_VERSIONS`` from this file's
text (it runs before specdec is installed), the ``vllm`` extra in ``pyproject.toml`` spells the same span (a test
checks they agree), and the plugin's start-up asks ``in_tested_span`` whether the running vLLM is one it knows.
Dependency-free on purpose: it must not import vLLM.
"""

from __future__ import annotations

import re

TESTED_VLLM_VERSIONS: tuple[str, ...] = ("0.26.0", "0.33.0")  # the oldest supported and the newest release
MIN_VLLM_VERSION = "0.26"  # inclusive lower bound of the supported span
MAX_VLLM_VERSION = "0.34"  # exclusive upper bound
VLLM_REQUIREMENT = f"vllm>={MIN_VLLM_VERSION},<{MAX_VLLM_VERSION}"  # as in pyproject.toml's ``vllm`` extra

RELEASE_PARTS = 3  # major.minor.patch: shorter releases are padded with zeros, longer ones cut
# PEP 440 release segment, optional "v" and epoch-free; what follows decides whether it is a pre-release.
_RELEASE = re.compile(r"v?(?P<release>\d+(?:\.\d+)*)(?P<rest>.*)")
# Pre-, dev- and release-candidate suffixes sort before their release (PEP 440); post and local ones after it.
_PRE_RELEASE = re.compile(r"^[-_.]?(a|b|c|rc|alpha|beta|pre|preview|dev)", re.IGNORECASE)


def _release_key(version: str) -> tuple[tuple[int, ...], int] | None:
    """(release padded to ``RELEASE_PARTS``, 0 for a pre/dev release else 1), or None when ``version`` does not start
    with a release number (e.g. ``"unknown"``)."""
    match = _RELEASE.fullmatch(version.strip())
    if match is None:
        return None
    parts = [int(part) for part in match["release"].split(".")][:RELEASE_PARTS]
    release = tuple(parts + [0] * (RELEASE_PARTS - len(parts)))
    return release, 0 if _PRE_RELEASE.match(match["rest"]) else 1


def in_tested_span(version: str) -> bool:
    """True if vLLM ``version`` (e.g. ``vllm.__version__``) lies in ``[MIN_VLLM_VERSION, MAX_VLLM_VERSION)``.

    Pre-releases order before their release, so ``0.26.0rc1`` is outside and ``0.34.0rc1`` too; local builds
    (``0.26.0+cu129``) and post releases count as their release. A string without a release number is outside:
    the plugin treats a vLLM it cannot place as one it was not tested with.
    """
    key = _release_key(version)
    low, high = _release_key(MIN_VLLM_VERSION), _release_key(MAX_VLLM_VERSION)
    assert low is not None and high is not None  # the bounds above are release numbers
    return key is not None and low <= key < (high[0], 0)
