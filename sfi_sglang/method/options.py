"""Per-request SFI options: custom_params["sfi"] parsed and checked against the server's
config and the model. The one home of request options: the tokenizer side checks them here
(HTTP 400 on a bad one) and the scheduler's `sfi` backend reads them through here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import os

from sfi_sglang.method.config import SFIConfig, SFIConfigError, cli_name

# Set (to "1") by sfi_sglang.engine when the server runs its decode steps eagerly (no CUDA
# graphs): only then may a request use options that the device-side step cannot serve.
EAGER_ENV = "SFI_SGLANG_EAGER_DECODE"
# Per-request options the device-side decode step serves (per-slot tensors: the trigger
# policy's counters, the SFI switch, dense layers beyond the server's).
DEVICE_OPTIONS = frozenset({"min_gap", "cooldown", "max_interval", "refresh", "adaptive_threshold",
                            "dense_layers"})

# custom_params key of a request's extra boundary token ids (set by sfi_sglang.router)
EXTRA_IDS_KEY = "sfi_extra_boundary_ids"
# Per-request options that count tokens: at most the model's context length (a larger one
# means nothing more; window or max_interval 10**12 overflowed the scheduler's int tensors).
TOKEN_COUNT_OPTIONS = ("window", "min_gap", "cooldown", "max_interval", "bootstrap_rows",
                       "page_size", "nms_radius", "pool_radius", "topup_pages", "selection_page")


@dataclass(frozen=True)
class ModelLimits:
    """The served model's shape that a request's options are checked against (besides
    the server's config): its layer count and context length."""

    num_layers: int
    context_len: int


def request_options(custom_params) -> tuple[bool, dict]:
    """(enabled, config overrides) from a request's custom_params["sfi"]; raises
    SFIConfigError on a bad value. `enabled` defaults to True."""
    if custom_params is None:
        return True, {}
    if not isinstance(custom_params, dict):
        raise SFIConfigError(f'"custom_params" must be a JSON object, got {_json_type(custom_params)}')
    opts = custom_params.get("sfi")
    if opts is None:
        return True, {}
    if not isinstance(opts, dict):
        raise SFIConfigError(f'custom_params["sfi"] must be a JSON object, got {_json_type(opts)}')
    opts = dict(opts)
    enabled = opts.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise SFIConfigError(f'custom_params["sfi"]["enabled"] must be true or false, got {enabled!r}')
    # extra boundaries of this request (a spec, resolved to token ids on the tokenizer
    # side by sfi_sglang.router into custom_params[EXTRA_IDS_KEY]); not a config field
    extra = opts.pop("extra_boundaries", None)
    if extra is not None:
        from sfi_sglang.method.boundary import parse_boundary_spec

        try:
            parse_boundary_spec(extra)
        except ValueError as err:
            raise SFIConfigError(f'custom_params["sfi"]["extra_boundaries"]: {err}') from None
    return enabled, opts


def request_config(server: SFIConfig, custom_params,
                   model: Optional[ModelLimits] = None) -> tuple[bool, SFIConfig]:
    """Validated per-request config on top of the server's; the budget may only shrink
    (the server sizes its buffers for its own budget). With `model` (the tokenizer side,
    before the request is queued), options are also checked against the model: dense
    layers below its layer count, token counts up to its context length."""
    enabled, overrides = request_options(custom_params)
    cfg = SFIConfig.from_dict(overrides, base=server) if overrides else server
    if model is not None:
        _check_model_limits(cfg, overrides, model)
    if cfg.budget > server.budget:
        raise SFIConfigError(
            f'custom_params["sfi"]["budget"] ({cfg.budget}) exceeds the server\'s '
            f"--sfi-budget ({server.budget})")
    if cfg.sinks != server.sinks:
        raise SFIConfigError(f'custom_params["sfi"]["sinks"] ({cfg.sinks}) cannot differ from the '
                             f"server's --sfi-sinks ({server.sinks})")
    if cfg.refresh == "adaptive" and server.refresh != "adaptive":
        raise SFIConfigError('custom_params["sfi"]["refresh"] adaptive needs a server launched with '
                             "--sfi-refresh adaptive (its fast steps then report what the trigger reads)")
    # server-wide: one table, one kernel, one decision per step
    for name in ("boundaries", "fast_path", "dense_backend", "dense_below", "max_slow_rows", "memory_rows"):
        if overrides.get(name, getattr(server, name)) != getattr(server, name):
            raise SFIConfigError(f'custom_params["sfi"]["{name}"] cannot differ from the server\'s '
                                 f"--sfi-{name.replace('_', '-')}")
    if not on_device_path(cfg, server) and os.environ.get(EAGER_ENV) != "1":
        other = sorted(k for k in overrides if k not in DEVICE_OPTIONS)
        what = (f"option(s) {', '.join(other)}" if other
                else "dense_layers without the server's --sfi-dense-layers")
        raise SFIConfigError(
            f'custom_params["sfi"]: {what} need a server launched with --disable-cuda-graph '
            f"(SFI's CUDA-graph decode step serves per request only {', '.join(sorted(DEVICE_OPTIONS))}, "
            "dense_layers as a superset of the server's, and enabled)")
    return enabled, cfg


def _check_model_limits(cfg: SFIConfig, overrides: dict, model: ModelLimits) -> None:
    if "dense_layers" in overrides and any(x >= model.num_layers for x in cfg.dense_layers):
        raise SFIConfigError(
            f'custom_params["sfi"]["dense_layers"] ({list(cfg.dense_layers)}) must be layer '
            f"indices below the model's {model.num_layers} layers")
    for name in TOKEN_COUNT_OPTIONS:
        if name in overrides and getattr(cfg, name) > model.context_len:
            raise SFIConfigError(
                f'custom_params["sfi"]["{name}"] ({getattr(cfg, name)}) exceeds the model\'s '
                f"context length ({model.context_len})")


def on_device_path(cfg: SFIConfig, server: SFIConfig) -> bool:
    """Whether the device-side decode step (sfi_sglang.method.step, the server's Selector, budget
    and window) serves a request with this config; otherwise it runs on the host path,
    eagerly only."""
    same = all(getattr(cfg, f) == getattr(server, f) for f in SFIConfig.__dataclass_fields__
               if f not in DEVICE_OPTIONS)
    return same and set(server.dense_layers) <= set(cfg.dense_layers) and not reference_only(cfg)


def reference_only(cfg: SFIConfig) -> list[str]:
    """The options of cfg that only the torch reference runs (baselines.HostPath, eager
    decode steps), as flags: the top-up on the FlashInfer fast path (the Triton paths read
    its pages in their kernel, sfi_sglang.method.topup)."""
    return [cli_name("topup_pages")] if cfg.topup_pages and cfg.fast_path == "flashinfer" else []


def _json_type(value) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", type(None): "null"}.get(type(value), type(value).__name__)
