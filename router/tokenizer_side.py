"""Tokenizer-manager side: the detector, the fan-out to every scheduler, the HTTP
endpoint `/sfi/boundaries` and the Engine methods.

The server-wide table (`--sfi-boundaries`) is built when the TokenizerManager starts
and sent when its event loop starts (SGLang's `auto_create_handle_loop`, i.e. before
the first request goes out on the same socket, so every request sees it). Run-time
updates go through `update()`; a bad spec raises ValueError (HTTP 400) before
anything is sent.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Optional

from fastapi import Request
from fastapi.responses import JSONResponse

from sfi_sglang.router.detector import BoundaryDetector
from sfi_sglang.router.messages import SFIBoundariesReqInput, SFIBoundariesReqOutput

logger = logging.getLogger(__name__)

ROUTE = "/sfi/boundaries"
DETECTOR: Optional[BoundaryDetector] = None  # this process's detector (the tokenizer manager's)
_STARTUP_SENT: set[int] = set()
_ROUTES_ADDED = False


def init_tokenizer_manager(tm) -> None:
    """After TokenizerManager.init_request_dispatcher: a communicator for our replies,
    the detector and the server-wide table, and the HTTP routes when serving."""
    global DETECTOR
    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.srt.runtime_context import get_parallel
    from sglang.utils import TypeBasedDispatcher

    comm = FanOutCommunicator(tm._dispatch_to_scheduler, get_parallel().num_dp_ranks)
    tm.sfi_boundaries_communicator = comm
    tm._result_dispatcher += TypeBasedDispatcher([(SFIBoundariesReqOutput, comm.handle_recv)])
    if getattr(tm, "tokenizer", None) is not None:
        DETECTOR = BoundaryDetector(tm.tokenizer, tm.model_config.vocab_size)
        if sfi_enabled(tm):
            from sfi_sglang.method.config import server_config

            DETECTOR.tables(server_config().boundaries)  # built now, sent with the first request
    add_http_routes()


def sfi_enabled(tm) -> bool:
    return getattr(tm.server_args, "attention_backend", None) == "sfi"


def send_startup(tm) -> None:
    """After TokenizerManager.auto_create_handle_loop: the first time, send the
    server-wide table (no reply expected)."""
    if id(tm) in _STARTUP_SENT or DETECTOR is None or not sfi_enabled(tm):
        return
    _STARTUP_SENT.add(id(tm))
    from sfi_sglang.method.config import server_config

    tm._dispatch_to_scheduler(DETECTOR.message(server_config().boundaries, reply=False))


def _result(replies: list[SFIBoundariesReqOutput], spec: Optional[str]) -> dict:
    return {"success": all(r.success for r in replies), "spec": spec,
            "version": DETECTOR.version if DETECTOR else 0,
            "schedulers": sorted((r.summary() for r in replies), key=lambda s: s["dp_rank"])}


async def query(tm) -> dict:
    """Current table of every scheduler (one entry per DP rank)."""
    tm.auto_create_handle_loop()
    replies = await tm.sfi_boundaries_communicator(SFIBoundariesReqInput(spec=None))
    return _result(replies, DETECTOR.spec if DETECTOR else None)


async def update(tm, spec) -> dict:
    """Build the table for `spec` here and install it in every scheduler."""
    if not isinstance(spec, str):
        raise ValueError(f'"boundaries" must be a boundary spec string, got {spec!r}')
    if DETECTOR is None:
        raise ValueError("SFI boundaries need the tokenizer (server runs with --skip-tokenizer-init)")
    if not sfi_enabled(tm):
        raise ValueError("SFI is disabled on this server (--disable-sfi)")
    tm.auto_create_handle_loop()
    try:
        msg = await asyncio.to_thread(DETECTOR.message, spec)
    except ValueError as err:
        raise ValueError(f"--sfi-boundaries: {err}") from None
    replies = await tm.sfi_boundaries_communicator(msg)
    return _result(replies, spec)


def extra_boundary_ids(spec) -> list[int]:
    """Per-request extra boundaries (custom_params["sfi"]["extra_boundaries"], same
    syntax as --sfi-boundaries) -> token ids, resolved with this process's detector."""
    if not isinstance(spec, str):
        raise ValueError(f'custom_params["sfi"]["extra_boundaries"] must be a boundary spec string, got {spec!r}')
    if DETECTOR is None:
        raise ValueError('custom_params["sfi"]["extra_boundaries"] needs the tokenizer')
    try:
        return DETECTOR.boundary_ids(spec)
    except ValueError as err:
        raise ValueError(f'custom_params["sfi"]["extra_boundaries"]: {err}') from None


# ---------------------------------------------------------------- HTTP and Engine
def add_http_routes() -> None:
    """GET/POST /sfi/boundaries on SGLang's FastAPI app, when this process serves it
    (the routes are added before the server starts listening). Auth is SGLang's own
    (`sglang.srt.utils.auth`, enforced by its middleware under --api-key/--admin-api-key):
    the POST changes every request's slow steps, so it is an admin endpoint like
    /flush_cache (ADMIN_OPTIONAL: the admin key when one is set, else the API key);
    the GET is a normal endpoint."""
    global _ROUTES_ADDED
    module = sys.modules.get("sglang.srt.entrypoints.http_server")
    if _ROUTES_ADDED or module is None:
        return
    _ROUTES_ADDED = True
    from sglang.srt.utils.auth import AuthLevel, auth_level

    def manager():
        return module.get_global_state().tokenizer_manager

    @auth_level(AuthLevel.NORMAL)
    async def get_boundaries():
        return JSONResponse(await query(manager()))

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def post_boundaries(request: Request):
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict) or "boundaries" not in body:
            return JSONResponse({"error": 'body must be a JSON object {"boundaries": "<spec>"}'},
                                status_code=400)
        try:
            result = await update(manager(), body["boundaries"])
        except ValueError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        return JSONResponse(result, status_code=200 if result["success"] else 500)

    module.app.add_api_route(ROUTE, get_boundaries, methods=["GET"])
    module.app.add_api_route(ROUTE, post_boundaries, methods=["POST"])


def engine_get_sfi_boundaries(self) -> dict:
    """sglang.Engine.get_sfi_boundaries(): the table summary of every scheduler."""
    return self.loop.run_until_complete(query(self.tokenizer_manager))


def engine_update_sfi_boundaries(self, spec: str) -> dict:
    """sglang.Engine.update_sfi_boundaries(spec): install a new boundary set in every
    scheduler (ValueError on a bad spec)."""
    return self.loop.run_until_complete(update(self.tokenizer_manager, spec))
