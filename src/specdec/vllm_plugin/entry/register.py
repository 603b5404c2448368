"""The ``vllm.general_plugins`` entry point (``specdec.vllm_plugin:register``).

vLLM loads general plugins in every process (front-end, engine core, workers), so ``register()`` is idempotent and
initialises no CUDA: it applies the "register" rows of the patch table (the speculative-config rewrite, the
async-scheduling whitelist and the scheduler's slot rows: the engine-core process, which holds the scheduler, builds
no proposer when the model runners live in worker processes, as under tensor parallelism). Each of those wrappers is a
pass-through for engines that are not ours. The model runner's rows are applied when the proposer is built
(``patches.table.apply_patches("all")``: the rows applied here are already in place and report so), which also logs
the start-up line of the whole table, once per engine.
"""

from __future__ import annotations

import logging

from specdec.vllm_plugin.logs import LOGGER_NAME
from specdec.vllm_plugin.patches.features import Feature
from specdec.vllm_plugin.patches.table import PatchReport, apply_patches

logger = logging.getLogger(LOGGER_NAME)


def register() -> PatchReport:
    """vLLM general-plugin entry point: idempotent, no CUDA initialisation. Returns the report of its rows."""
    report = apply_patches("register")
    why = report.features().get(Feature.METHOD)
    if why:
        logger.warning("specdec: method='specdec' unavailable (%s); use the custom_class form", why)
    return report
