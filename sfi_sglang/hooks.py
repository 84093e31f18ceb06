"""Every change sfi-sglang makes to SGLang's own functions, in one place, each applied
through SGLang's plugin HookRegistry (sglang.srt.plugins.hook_registry) and each with
the reason no dedicated extension point exists for it.

(The `sfi` attention backend itself uses the supported register_attention_backend and
add_attention_backend_choices; the CPU stand-in for sgl_kernel lives in _startup.py.)
"""

from __future__ import annotations

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

OUTPUT_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
SAMPLING_PARAMS = "sglang.srt.sampling.sampling_params.SamplingParams"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

META_KEY = "sfi"


def install() -> None:
    HookRegistry.register(f"{SAMPLING_PARAMS}.verify", _verify_sfi_params, HookType.AFTER)
    HookRegistry.register(f"{SCHEDULER}.handle_generate_request", _record_request_options,
                          HookType.BEFORE)
    HookRegistry.register(f"{OUTPUT_STREAMER}.build_additional_customized_info",
                          _build_sfi_info, HookType.REPLACE)
    HookRegistry.register(f"{TOKENIZER_MANAGER}.update_request_meta_info",
                          _update_meta_info, HookType.AROUND)
    # SchedulerOutputStreamer only calls build_additional_customized_info when this
    # class flag is set (SGLang expects a subclass to set it; the scheduler builds the
    # streamer itself, so there is no way to hand it a subclass).
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer

    SchedulerOutputStreamer.has_additional_customized_info = True


def _verify_sfi_params(result, self, *args, **kwargs):
    """Per-request options custom_params["sfi"] are checked where SGLang checks all
    sampling params, so a bad one becomes HTTP 400 (ValueError) before it is queued.
    SamplingParams.verify has no extension point for custom_params."""
    from sfi_sglang.backend import request_config
    from sfi_sglang.config import server_config

    request_config(server_config(), self.custom_params)
    return result


def _record_request_options(self, recv_req, *args, **kwargs):
    """The backend needs each request's custom_params["sfi"], but ForwardBatch carries
    custom_params only when custom logit processors are enabled; record them by rid as
    the scheduler receives the request."""
    from sfi_sglang.backend import REQUEST_PARAMS

    params = getattr(recv_req.sampling_params, "custom_params", None)
    if params:
        REQUEST_PARAMS[recv_req.rid] = params


def _build_sfi_info(self, reqs):
    """meta_info["sfi"] of each emitted request, read from the scheduler's SFI backend."""
    from sfi_sglang.backend import ACTIVE

    if not ACTIVE:
        return {}
    backend = ACTIVE[0]
    return {META_KEY: [[backend.request_stats(r.rid, r.finished())] for r in reqs]}


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
