"""Every change sfi-sglang makes to SGLang's own functions, in one place, each applied
through SGLang's plugin HookRegistry (sglang.srt.plugins.hook_registry) and each with
the reason no dedicated extension point exists for it.

(The `sfi` attention backend itself uses the supported register_attention_backend and
add_attention_backend_choices; the stand-ins for sgl_kernel live in _startup.py and
sgl_kernel_standin.py.)
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

OUTPUT_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
SAMPLING_PARAMS = "sglang.srt.sampling.sampling_params.SamplingParams"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
KV_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
REQ_TO_TOKEN_POOL = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
MODEL_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
DP_CONTROLLER = "sglang.srt.managers.data_parallel_controller.DataParallelController"
DECODE_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner"

META_KEY = "sfi"


def install() -> None:
    HookRegistry.register(f"{SAMPLING_PARAMS}.verify", _verify_sfi_params, HookType.AFTER)
    HookRegistry.register(f"{SCHEDULER}.handle_generate_request", _record_request_options,
                          HookType.BEFORE)
    HookRegistry.register(f"{OUTPUT_STREAMER}.build_additional_customized_info",
                          _build_sfi_info, HookType.REPLACE)
    HookRegistry.register(f"{TOKENIZER_MANAGER}.update_request_meta_info",
                          _update_meta_info, HookType.AROUND)
    HookRegistry.register(f"{SCHEDULER}.get_internal_state", _add_sfi_state, HookType.AFTER)
    HookRegistry.register(f"{SCHEDULER}.init_metrics_collector", _add_sfi_metrics, HookType.AFTER)
    HookRegistry.register(f"{TOKENIZER_MANAGER}.__init__", _add_stats_route, HookType.AFTER)
    HookRegistry.register(f"{TOKENIZER_MANAGER}.__init__", _record_model_limits, HookType.AFTER)
    HookRegistry.register(f"{TOKENIZER_MANAGER}._validate_one_request", _check_prompt,
                          HookType.BEFORE)
    HookRegistry.register(f"{SCHEDULER}.init_request_dispatcher", _add_scheduler_dispatch,
                          HookType.AFTER)
    HookRegistry.register(f"{TOKENIZER_MANAGER}.init_request_dispatcher",
                          _add_tokenizer_dispatch, HookType.AFTER)
    HookRegistry.register(f"{TOKENIZER_MANAGER}.auto_create_handle_loop",
                          _send_startup_boundaries, HookType.AFTER)
    # Engine methods for run-time boundary updates: sfi_sglang.Engine returns SGLang's
    # own Engine (no subclass to put methods on), so they are added to its class.
    # Only where the Engine module is loaded already (the process that builds an Engine).
    import sys

    engine_module = sys.modules.get("sglang.srt.entrypoints.engine")
    if engine_module is not None:
        from sfi_sglang.router import tokenizer_side

        engine_module.Engine.get_sfi_boundaries = tokenizer_side.engine_get_sfi_boundaries
        engine_module.Engine.update_sfi_boundaries = tokenizer_side.engine_update_sfi_boundaries
    # SchedulerOutputStreamer only calls build_additional_customized_info when this
    # class flag is set (SGLang expects a subclass to set it; the scheduler builds the
    # streamer itself, so there is no way to hand it a subclass).
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    SchedulerOutputStreamer.has_additional_customized_info = True
    HookRegistry.register(f"{KV_CONFIGURATOR}._profile_available_bytes", _reserve_sfi_memory,
                          HookType.AROUND)
    HookRegistry.register(f"{REQ_TO_TOKEN_POOL}.free_rows", _release_sfi_rows, HookType.AFTER)
    HookRegistry.register(f"{MODEL_RUNNER}.maybe_enable_batch_invariant_mode",
                          _batch_invariant_mode, HookType.AROUND)
    HookRegistry.register(f"{DP_CONTROLLER}.event_loop", _dp_controller_sleeps_on_idle, HookType.AROUND)
    HookRegistry.register(f"{DECODE_GRAPH_RUNNER}.create_attention_graph_variants", _sfi_graph_variants,
                          HookType.AROUND)
    # Under sgl_kernel's torch stand-in (a GPU without sglang-kernel, SFI_SGLANG_TORCH_KERNELS):
    # every CUDA model's MLP asks the CUTLASS DSL module whether its SM100 dual GEMM applies,
    # importing the nvidia-cutlass-dsl package that comes with sglang-kernel's stack. Without
    # that package the answer is "no" (SGLang's plain path), not a crash.
    import os

    if os.environ.get("SFI_SGLANG_TORCH_KERNELS") == "1":
        HookRegistry.register("sglang.srt.layers.dual_gemm.DualGemm._select_mode",
                              _no_dual_gemm_without_cutlass, HookType.AROUND)


def _sfi_graph_variants(original, *args, **kwargs):
    """--sfi-dense-below: SGLang's decode graph runner captures a graph per batch size and
    attention variant and picks one per replay (DSA's dense and sparse decode), but asks for
    the variants from the model's config alone (create_attention_graph_variants, no backend
    hook); the `sfi` backend of this process supplies its own where the model has none."""
    variants = original(*args, **kwargs)
    from sfi_sglang.integration import state

    backend = state.active()
    if variants is None and backend is not None:
        variants = backend.graph_variants()
    return variants


def _dp_controller_sleeps_on_idle(original, self):
    """--sleep-on-idle for the data-parallel controller (--dp-size > 1). SGLang's scheduler
    blocks in a zmq poll when idle under that flag, but its DP controller's event loop
    polls the tokenizer socket without blocking, forever: a whole core per DP server, idle
    or not (on the CPU engine it took a core from the schedulers it feeds). With the flag
    the loop here drains the socket as SGLang's does, then waits in a zmq poll of at most
    1 s for the next request (feeding the watchdog each time). Not a scheduler, so SGLang's
    IdleSleeper does not reach it; no extension point exists for it."""
    from sglang.srt.runtime_context import get_device

    if not get_device().sleep_on_idle:
        return original(self)
    import zmq
    from sglang.srt.managers import data_parallel_controller as dpc

    poller = zmq.Poller()
    poller.register(self.recv_from_tokenizer, zmq.POLLIN)
    while True:
        while True:
            self.soft_watchdog.feed()
            try:
                recv_req = dpc.sock_recv(self.recv_from_tokenizer, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            self._request_dispatcher(recv_req)
        poller.poll(1000)


def _batch_invariant_mode(original, self, *args, **kwargs):
    """--enable-deterministic-inference. The method is SGLang's switch for the mode, with no
    extension point for another device or for a backend's own kernels.
    - CPU engine: SGLang's batch-invariant ops are GPU kernels and raise there; the CPU's
      own GEMM is made batch-invariant instead (sfi_sglang.integration.batch_invariant).
    - GPU: SGLang's ops, and SFI's kernels pick their split-K counts as for a batch of one
      (kernels.set_batch_invariant): on the H200 dense SGLang gave a request the same
      1,000 tokens alone and among 32 in this mode, SFI did not while its split counts
      followed the batch (bench/results/garbage_h200.log)."""
    from sglang.srt.runtime_context import get_exec

    if not get_exec().deterministic.enable_deterministic_inference:
        return original(self, *args, **kwargs)
    if str(self.device).startswith("cpu"):
        from sfi_sglang.integration import batch_invariant

        batch_invariant.enable()
        return None
    from sfi_sglang.kernels import set_batch_invariant

    set_batch_invariant(True)
    return original(self, *args, **kwargs)


def _reserve_sfi_memory(original, self, *args, **kwargs):
    """SGLang sizes its KV pool from this one byte count (what mem_fraction_static leaves
    after the weights), and the `sfi` backend allocates its own tensors afterwards. Without
    this they come out of the activation headroom instead: on the H200, 64 request slots of
    Qwen3-4B (290 MB each at --sfi-budget 2048) ran a 32K prefill out of memory
    (bench/NOTES.md section 6). No extension point exists for it."""
    available = original(self, *args, **kwargs)
    sa = self.server_args
    if "sfi" not in {sa.attention_backend, getattr(sa, "decode_attention_backend", None),
                     getattr(sa, "prefill_attention_backend", None)}:
        return available
    from sfi_sglang.method.config import server_config
    from sfi_sglang.method.memory import kv_budget
    from sfi_sglang.method.step import ScoreBuffers, score_rows

    packed = str(self.device).startswith("cuda")
    cfg = server_config().on_device(packed)
    mc = self.model_config
    # without --max-running-requests SGLang makes 2048-4096 request slots
    # (KVCacheConfigurator.resolve_max_num_reqs); sfi_sglang's launchers always set it
    slots = sa.max_running_requests or 4096
    num_layers = mc.num_hidden_layers
    scores = 0
    kv_heads = mc.get_num_kv_heads(sa.tp_size)
    if packed:  # the backend's ScoreBuffers: a step's score rows, req_to_token's width
        from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len

        width = mc.context_len + get_req_to_token_extra_context_len()
        # auto: as many rows as the pool holds requests, so the limit is --sfi-max-slow-rows
        rows = 0 if cfg.memory_rows == "auto" else cfg.memory_rows
        scores = ScoreBuffers.reserve_bytes(score_rows(slots + 1, cfg.max_slow_rows, rows),
                                            len(cfg.sparse_layers(num_layers)),
                                            max(1, mc.num_attention_heads // sa.tp_size), kv_heads,
                                            width, batched=cfg.method == "sfi")
    budget = kv_budget(available, num_layers, kv_heads, mc.head_dim, cfg, self.kv_cache_dtype, packed,
                       slots, scores, group=max(1, mc.num_attention_heads // sa.tp_size // kv_heads),
                       q_dtype=getattr(mc, "dtype", None), rows=cfg.memory_rows or None,
                       page_size=sa.page_size or 1)
    MEMORY.update(available=int(available), kv_budget=budget, reserved=int(available) - budget,
                  scores=scores, slots=slots + 1, rows=cfg.memory_rows or slots + 1,  # _add_sfi_state: the backend's
                  # SFI's KV pool against the one dense SGLang would size from the same bytes
                  pool_of_dense=round(budget / available, 4) if available > 0 else None)
    return budget


# this scheduler's SFI memory reservation (_reserve_sfi_memory), reported by _add_sfi_state
MEMORY: dict = {}


def _release_sfi_rows(result, self, indices, *args, **kwargs):
    """SGLang freed request slots (a request finished, was aborted or retracted): the `sfi`
    backend gives their memory rows back (--sfi-memory-rows). ReqToTokenPool tells its
    users of the slots it gives out (register_on_alloc_rows), not of those it takes back."""
    slots = getattr(self, "sfi_slots", None)
    if slots is not None:
        slots.on_free_rows(indices)
    return result


def _no_dual_gemm_without_cutlass(original, self, *args, **kwargs):
    try:
        return original(self, *args, **kwargs)
    except ModuleNotFoundError as err:
        if err.name != "cutlass":
            raise
        return None


def _verify_sfi_params(result, self, *args, **kwargs):
    """Per-request options custom_params["sfi"] are checked where SGLang checks all
    sampling params, so a bad one becomes HTTP 400 (ValueError) before it is queued;
    against the model too (MODEL_LIMITS) in the tokenizer manager's process.
    SamplingParams.verify has no extension point for custom_params."""
    from sfi_sglang.method.config import server_config
    from sfi_sglang.method.options import request_config

    request_config(server_config(), self.custom_params, MODEL_LIMITS.get("model"))
    _resolve_extra_boundaries(self.custom_params)
    return result


# this process's model shape (sfi_sglang.method.options.ModelLimits), set by _record_model_limits
MODEL_LIMITS: dict = {}


def _record_model_limits(result, self, *args, **kwargs):
    """The model's layer count and context length, for checking request options in
    SamplingParams.verify (_verify_sfi_params), which sees only the sampling params."""
    from sfi_sglang.method.options import ModelLimits

    MODEL_LIMITS["model"] = ModelLimits(num_layers=self.model_config.num_hidden_layers,
                                        context_len=self.context_len)
    return result


def _check_prompt(self, obj, input_ids=None, *args, **kwargs):
    """An empty prompt, or input_ids outside the model's vocabulary, pass SGLang's request
    validation and crash the scheduler (the whole server) in the forward pass, with SFI
    or without; rejected here (ValueError: HTTP 400) before the request is queued.
    _validate_one_request is where SGLang checks each tokenized request; it has no
    extension point."""
    if getattr(obj, "input_embeds", None) is not None or input_ids is None:
        return None  # embeddings, or a multimodal processor supplies the ids
    given = getattr(obj, "input_ids", None) is not None
    if len(input_ids) == 0:
        field = "input_ids" if given else "text"
        raise ValueError(f'"{field}" is empty: a request needs at least one prompt token')
    if given:  # the client's own ids (the tokenizer's are in range)
        vocab = self.model_config.vocab_size
        bad = next((i for i, t in enumerate(obj.input_ids)
                    if type(t) is not int or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f'"input_ids"[{bad}] = {obj.input_ids[bad]!r} is not a token id '
                             f"of this model (an integer in [0, {vocab}))")
    return None


def _resolve_extra_boundaries(custom_params):
    """custom_params["sfi"]["extra_boundaries"] (a boundary spec) -> token ids in
    custom_params[EXTRA_IDS_KEY], on the tokenizer side (which owns the vocabulary
    texts), so the scheduler only looks ids up."""
    from sfi_sglang.method.config import SFIConfigError
    from sfi_sglang.method.options import EXTRA_IDS_KEY
    from sfi_sglang.router import tokenizer_side

    if not isinstance(custom_params, dict):
        return
    opts = custom_params.get(META_KEY)
    spec = opts.get("extra_boundaries") if isinstance(opts, dict) else None
    if spec is None and EXTRA_IDS_KEY in custom_params:  # only this function sets it
        raise SFIConfigError(f"custom_params[{EXTRA_IDS_KEY!r}] is internal: use "
                             'custom_params["sfi"]["extra_boundaries"] (a boundary spec)')
    if spec is not None:
        try:
            custom_params[EXTRA_IDS_KEY] = tokenizer_side.extra_boundary_ids(spec)
        except ValueError as err:
            raise SFIConfigError(str(err)) from None
    ids = custom_params.get(EXTRA_IDS_KEY)
    if ids is not None and not (isinstance(ids, list) and all(
            isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise SFIConfigError(f"custom_params[{EXTRA_IDS_KEY!r}] must be a list of token ids")


def _add_scheduler_dispatch(result, self, *args, **kwargs):
    """The scheduler's dispatcher entry for SFIBoundariesReqInput (the tokenizer side's
    boundary table). SGLang's custom-message support is io_struct.hook_custom_types
    (done in plugin.py) for the wire format; the scheduler builds its dispatcher from a
    fixed list, so the entry is added right after it is built."""
    from sglang.utils import TypeBasedDispatcher

    from sfi_sglang.router import scheduler_side
    from sfi_sglang.router.messages import SFIBoundariesReqInput

    self._request_dispatcher += TypeBasedDispatcher(
        [(SFIBoundariesReqInput, lambda req: scheduler_side.handle(self, req))])
    return result


def _add_tokenizer_dispatch(result, self, *args, **kwargs):
    """The tokenizer manager's result-dispatcher entry for SFIBoundariesReqOutput, its
    fan-out communicator and detector, and GET/POST /sfi/boundaries (same reason as
    above: the result dispatcher is a fixed list built in init_request_dispatcher)."""
    from sfi_sglang.router import tokenizer_side

    tokenizer_side.init_tokenizer_manager(self)
    return result


def _send_startup_boundaries(result, self, *args, **kwargs):
    """The server-wide boundary table goes to the schedulers once the tokenizer
    manager's event loop exists, ahead of the first request on the same socket; SGLang
    has no start-up hook after its schedulers are connected."""
    from sfi_sglang.router import tokenizer_side

    tokenizer_side.send_startup(self)
    return result


def _record_request_options(self, recv_req, *args, **kwargs):
    """The backend needs each request's custom_params["sfi"], but ForwardBatch carries
    custom_params only when custom logit processors are enabled; record them by rid as
    the scheduler receives the request."""
    from sfi_sglang.integration import state

    params = getattr(recv_req.sampling_params, "custom_params", None)
    if params and isinstance(params, dict):  # checked on the tokenizer side (_verify_sfi_params)
        state.REQUEST_PARAMS[recv_req.rid] = params


def _build_sfi_info(self, reqs):
    """meta_info["sfi"] of each emitted request, read from the scheduler's SFI backend;
    SFI's Prometheus series (sfi_sglang.integration.metrics) are updated here too, where the host
    reads the requests' counters anyway."""
    from sfi_sglang.integration import metrics, radix, state

    backend = state.active()
    if backend is None:
        return {}
    info = {META_KEY: [[_stats(backend, r)] for r in reqs]}
    if metrics.METRICS is not None:
        metrics.METRICS.update_state(backend, radix.CACHES[-1].memories if radix.CACHES else None)
    return info


def _stats(backend, req):
    from sfi_sglang.integration import metrics

    finished = req.finished()
    entry = backend.slots.by_rid.get(req.rid) if finished else None
    stats = backend.slots.request_stats(req.rid, finished)
    if stats is not None and entry is not None and metrics.METRICS is not None:
        cfg = entry[1].cfg
        metrics.METRICS.request_finished(stats, cfg.max_interval, cfg.refresh == "interval")
    if stats is not None:  # which boundary table (sfi_sglang.router) the request ran with
        stats["boundary_version"] = backend.boundaries["version"]
    if stats is not None and finished:
        from sfi_sglang.eval import pop_result  # teacher-forcing scores (sfi-sglang eval)

        score = pop_result(req.rid)
        if score is not None:
            stats["eval"] = score
    return stats


def _update_meta_info(original, self, meta_info, state, customized_info, index, finish_reason):
    """SGLang accumulates customized info into lists; SFI's counters are a snapshot, so
    meta_info["sfi"] is the latest dict. TokenizerManager exposes this method for
    subclasses, but the server constructs its own TokenizerManager."""
    if META_KEY in customized_info:
        customized_info = dict(customized_info)
        values = customized_info.pop(META_KEY)[index]
        latest = values[-1] if values else None
        if latest is not None:
            meta_info[META_KEY] = latest
    return original(self, meta_info, state, customized_info, index, finish_reason)


def _add_sfi_state(result, self, *args, **kwargs):
    """The scheduler's SFI sharing counters (sfi_sglang.integration.radix.stats) and memory reservation
    (_reserve_sfi_memory) join its internal
    state, which SGLang serves at /server_info and Engine.get_server_info(); the internal
    state is assembled from a fixed list of contributors with no extension point."""
    from sfi_sglang.integration import parallel, radix, state

    memory = dict(MEMORY)
    be = state.active()
    if be is not None:  # what the backend allocated against what was reserved for it
        summaries = 0 if be.summaries is None else be.summaries.bytes()
        memory.update(allocated=be.memory.bytes() + be.scores.bytes() + summaries,
                      allocated_scores=be.scores.bytes(), allocated_page_summaries=summaries,
                      allocated_slots=be.memory.max_slots,
                      rows=be.memory.rows.total, pool_tokens=be.token_to_kv_pool.size,
                      rows_free=-1 if be.memory.rows.count is None else be.memory.rows.count - be.slots.rows_held,
                      rows_waiting=be.slots.waiting)
    result.internal_state[META_KEY] = {**radix.stats(), "memory": memory,
                                       "requests": _request_maps(),
                                       # every TP rank's summary (a collective over the TP group:
                                       # each rank runs get_internal_state for the request)
                                       "tp_ranks": parallel.tp_gather(self, parallel.rank_summary(self))}
    return result


def _request_maps() -> dict:
    """Sizes of this scheduler's per-request state: every map keyed by request (rid or
    slot) that SFI keeps; all 0 once no request is queued or running (a request's entries
    go when it finishes, is aborted or is released by the radix cache)."""
    from sfi_sglang import eval as sfi_eval
    from sfi_sglang.integration import radix, state

    be = state.active()
    slots = be.slots if be is not None else None
    by_rid = len(slots.by_rid) if slots is not None else 0
    return {"slots_in_use": by_rid,  # requests holding a memory slot (reported at finish)
            "request_params": len(state.REQUEST_PARAMS),  # rid -> custom_params (state.py)
            "by_rid": by_rid,  # rid -> (slot, Request) (Slots.by_rid)
            "slot_records": len(slots.requests) if slots is not None else 0,  # Slots.requests
            "retracted": len(slots.suspended) if slots is not None else 0,  # Slots.suspended
            "radix_matched": sum(c.tracked()[0] for c in radix.CACHES),  # SFIRadixCache._reqs
            "radix_started": sum(c.tracked()[1] for c in radix.CACHES),  # SFIRadixCache._started
            "eval_results": sfi_eval.pending_results()}


def _add_sfi_metrics(result, self, *args, **kwargs):
    """SFI's Prometheus series (sfi_sglang.integration.metrics), made in this scheduler process with
    SGLang's scheduler labels when SGLang makes its own collector (--enable-metrics; the
    ranks SGLang exports from). SGLang's collector is a fixed class with no extension
    point for other series."""
    ctx = getattr(self, "metrics_collector_context", None)
    collector = getattr(ctx, "collector", None)
    if collector is not None and ctx.current_scheduler_metrics_enabled:
        from sfi_sglang.integration import metrics

        metrics.init(collector.labels)
    return result


def _add_stats_route(result, self, *args, **kwargs):
    """GET /sfi/stats: the schedulers' SFI counters. The HTTP app is a module-level FastAPI
    object that builds its TokenizerManager itself (no hook to hand it routes), so the
    route is added once that manager exists, in the process that serves HTTP."""
    import sys

    http = sys.modules.get("sglang.srt.entrypoints.http_server")
    app = getattr(http, "app", None)
    if app is None or any(getattr(r, "path", None) == "/sfi/stats" for r in app.routes):
        return result
    manager = self
    from sglang.srt.utils.auth import AuthLevel, auth_level

    @auth_level(AuthLevel.NORMAL)  # read-only, like /server_info
    async def sfi_stats():
        states = await manager.get_internal_state()
        per_rank = [s.get(META_KEY) for s in states]
        return per_rank[0] if len(per_rank) == 1 else {"ranks": per_rank}

    app.add_api_route("/sfi/stats", sfi_stats, methods=["GET"])
    return result
