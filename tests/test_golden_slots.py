"""Golden slot grants: what schedule mode's slot book grants, recorded once and compared on every later commit.

The slot book (``modes/slots.py``) keeps state; the drafting policy (``core/policy.py``) decides its widths. A move
between them must not change a grant. This test drives ``SlotBook.policy`` over seeded random schedules (every k the
plugin serves, narrow graphs on and off, growth on and off, prefill caps, the back-off's low batch and the ragged-graph
flag flipping, requests arriving and leaving, drafts of every length and unknown ones, stale books) and compares a
digest of each scenario's widths and grants, and its final statistics, with ``tests/golden/slots.json``. The file was
recorded at 2758db5 (before the widths moved to ``core/policy.py``) and matches after the move. After a deliberate
change of the policy, rewrite it with ``SPECDEC_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_slots.py`` and say
why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

from specdec.vllm_plugin.modes.slots import UNKNOWN, SlotBook

GOLDEN = Path(__file__).parent / "golden" / "slots.json"
UPDATE_ENV = "SPECDEC_UPDATE_GOLDEN"
SCENARIOS = 48
SCHEDULES = 200
KS = (3, 4, 6, 8, 12, 16)
BATCHES = (1, 4, 12, 40, 80)
GROWTHS = (0.0, 0.5, 1.0)  # 0: slots = the latest draft's length; 1.0: the policy's SLOT_GROWTH


def scenario(seed: int) -> dict[str, Any]:
    """One seeded run of a slot book: a digest of every schedule's width and grants, and the book's statistics."""
    rng = random.Random(seed)
    k = rng.choice(KS)
    low, ragged = [False], [False]
    book = SlotBook.policy(
        k,
        narrow=rng.random() < 0.8,
        prefill_cap=rng.choice([-1, 2, 4]),
        high_ragged=(lambda: ragged[0]) if rng.random() < 0.7 else None,
        growth=rng.choice(GROWTHS),
        low_batch=(lambda: low[0]) if rng.random() < 0.7 else None,
    )
    first = rng.choice(BATCHES)
    active, arrived = [f"r{i}" for i in range(first)], first
    acceptance = rng.random()
    digest, widths = hashlib.sha256(), set()
    for _ in range(SCHEDULES):
        acceptance = rng.random() if rng.random() < 0.05 else acceptance
        low[0], ragged[0] = rng.random() < 0.2, rng.random() < 0.5
        if active and rng.random() < 0.2:
            active.pop(rng.randrange(len(active)))
        if rng.random() < 0.2:
            active.append(f"r{arrived}")
            arrived += 1
        book.begin_schedule(len(active))
        grants = [book.slots(r, rng.choice([k, k, k, max(0, k - 2)]), fresh=rng.random() < 0.9) for r in active]
        if rng.random() < 0.1:
            book.cap_grants()
        emitted = [1 + sum(rng.random() < acceptance for _ in range(g)) if rng.random() < 0.95 else 0 for g in grants]
        lengths = [UNKNOWN if rng.random() < 0.05 else rng.randint(0, k) for _ in active]
        book.note(active, lengths, emitted=emitted if rng.random() < 0.9 else (), token_cost=rng.random() * 0.3)
        digest.update(json.dumps([book.width, grants]).encode())
        widths.add(book.width)
    stats = {key: round(v, 9) if isinstance(v, float) else v for key, v in book.as_dict().items()}
    return {"grants": digest.hexdigest()[:16], "widths": sorted(widths), "stats": stats}


def test_slot_grants_match_the_golden_file():
    now = {str(seed): scenario(seed) for seed in range(SCENARIOS)}
    assert len({w for s in now.values() for w in s["widths"]} - {0}) >= 3  # every narrow width is covered
    for key in ("low_batch_schedules", "growth_notes", "ragged_high_mat_steps", "growth_extra_slots"):
        assert sum(s["stats"][key] for s in now.values()) > 0, key  # low batches, growth and its settling, ragged steps
    if os.environ.get(UPDATE_ENV):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert now.keys() == golden.keys()
    for seed, want in golden.items():
        assert now[seed] == want, f"scenario {seed}: slot grants or statistics changed (see the docstring)"
