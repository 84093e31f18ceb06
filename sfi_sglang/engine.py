"""Launch settings shared by `sfi_sglang.Engine` and `sfi-sglang serve`: the embedded
default model, CPU settings on machines without a GPU, and the `sfi` attention backend."""

from __future__ import annotations

import os
from typing import Any

from sfi_sglang.config import SFIConfig, export_config

# SGLang settings for its CPU engine (SGLANG_USE_CPU_ENGINE=1). A user's own value wins.
CPU_DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "disable_overlap_schedule": True,
    "mem_fraction_static": 0.3,
}


# SGLang's --max-running-requests when SFI is on and the user gives none
SFI_MAX_RUNNING_REQUESTS = 64


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def dense_backend() -> str:
    """The platform's dense attention backend, the one SFI wraps (and --disable-sfi uses)."""
    return "triton" if has_gpu() else "torch_native"


def launch_kwargs(kwargs: dict[str, Any], cfg: SFIConfig, enabled: bool) -> dict[str, Any]:
    """SGLang server arguments with our defaults filled in where the user gave none."""
    out = dict(kwargs)
    if not out.get("model_path"):
        from sfi_sglang.model import default_model_path

        out["model_path"] = default_model_path()
    if not has_gpu():
        os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
        for key, value in CPU_DEFAULTS.items():
            out.setdefault(key, value)
    if enabled:
        if out.get("attention_backend") not in (None, "sfi"):
            raise ValueError(
                f"attention_backend={out['attention_backend']!r} conflicts with SFI; "
                "drop it (SFI runs its own dense backend for slow steps) or disable SFI"
            )
        out["attention_backend"] = "sfi"
        # SFI keeps SGLang's CUDA graphs and overlap scheduler (its decode step is device
        # work: sfi_sglang.step). Without graphs, per-request options that the device step
        # cannot serve are allowed too (sfi_sglang.requests.on_device_path).
        from sfi_sglang.requests import EAGER_ENV

        os.environ[EAGER_ENV] = "1" if out.get("disable_cuda_graph") else "0"
        if cfg.fast_path == "flashinfer" and has_gpu() and not out.get("disable_cuda_graph"):
            raise ValueError("--sfi-fast-path flashinfer plans each step on the host: it needs "
                             "--disable-cuda-graph (or keep the default --sfi-fast-path triton)")
        # Each request slot holds SFI's sparse memory (on CUDA ~0.3 GB for Qwen3-4B at the
        # default budget, SparseMemory.slot_bytes); SGLang's default is 2048+ slots.
        out.setdefault("max_running_requests", SFI_MAX_RUNNING_REQUESTS)
        if not out.get("disable_radix_cache"):  # shared prefixes share SFI memories
            out.setdefault("radix_cache_backend", "sfi")
        export_config(cfg)
    else:
        out.setdefault("attention_backend", dense_backend())
    return out


def Engine(*, disable_sfi: bool = False, **kwargs):
    """`sglang.Engine` with SFI: takes every sglang.Engine argument plus `sfi_<field>`
    for each SFIConfig field (e.g. sfi_budget=1024) and `disable_sfi=True`."""
    import sglang

    sfi = {k[len("sfi_"):]: kwargs.pop(k) for k in list(kwargs) if k.startswith("sfi_")}
    cfg = SFIConfig.from_dict(sfi)
    return sglang.Engine(**launch_kwargs(kwargs, cfg, enabled=not disable_sfi))
