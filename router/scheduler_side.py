"""Scheduler side of the boundary messages: install a table in this process's `sfi`
backends and report what is installed. Runs in the scheduler's request dispatcher,
between forward passes, so a decode step never waits for it (and never for the
tokenizer side: until a table arrives the backend keeps the one it has)."""

from __future__ import annotations

import logging
import os

from sfi_sglang.router.detector import decode_tables
from sfi_sglang.router.messages import SFIBoundariesReqInput, SFIBoundariesReqOutput

logger = logging.getLogger(__name__)


def handle(scheduler, req: SFIBoundariesReqInput):
    from sglang.srt.runtime_context import get_parallel

    from sfi_sglang.integration import state

    # SGLang 0.5.23's Scheduler has no dp_rank attribute: the rank is in its runtime context
    out = SFIBoundariesReqOutput(rid=req.rid, pid=os.getpid(),
                                 dp_rank=get_parallel().dp_rank or 0,
                                 tp_size=getattr(scheduler, "tp_size", 1) or 1, sfi=state.active() is not None)
    try:
        if req.spec is not None:
            for backend in state.BACKENDS:  # one per model runner of this scheduler
                is_b, is_c = decode_tables(req, backend.policy.vocab)
                backend.install_boundaries(is_b, is_c, spec=req.spec, version=req.version)
            logger.info("SFI boundaries v%d installed: %r (%d boundary tokens)", req.version,
                        req.spec, len(req.boundary_ids))
    except Exception as err:  # report, never take the scheduler down
        logger.exception("SFI boundary table rejected")
        out.success, out.message = False, f"{type(err).__name__}: {err}"
    if state.active() is not None:
        for key, value in state.active().boundaries.items():
            setattr(out, key, value)
    if req.reply and (getattr(scheduler, "tp_size", 1) or 1) > 1:
        # every TP rank handles the message (SGLang broadcasts requests to the TP group);
        # rank 0 replies with each rank's table (sfi_sglang.integration.parallel)
        from sfi_sglang.integration.parallel import tp_gather, tp_rank

        mine = {"tp_rank": tp_rank(), "pid": os.getpid(),
                "success": out.success, "spec": out.spec, "version": out.version,
                "num_boundary": out.num_boundary}
        out.tp_ranks = tp_gather(scheduler, mine)
    return out if req.reply else None
