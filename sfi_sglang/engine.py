"""Launch settings shared by `sfi_sglang.Engine` and `sfi-sglang serve`: the embedded
default model, CPU settings on machines without a GPU, and the `sfi` attention backend."""

from __future__ import annotations

import os
from typing import Any

from sfi_sglang.method.config import SFIConfig, export_config

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

# SGLang's --triton-attention-num-kv-splits when SFI is on and the user gives none: the cap
# on the KV splits of SGLang's triton decode, which runs SFI's dense layers (--sfi-dense-
# layers) and SFI-off rows. Under the cap SGLang picks each step's split count from the
# device's SM count, the batch and the longest context (its get_num_kv_splits), so the cap
# binds only at small batches and long contexts, where SGLang's default of 8 leaves most of
# the GPU idle: on the H200 at 128K, batch 1, a dense step took 61.2 ms with 8 splits and
# 14.3 ms with 64, and SFI 8.1 ms with 64 (10.7 ms with 8, uncommitted); at batch 8
# the heuristic uses 15-23 splits from 8K to 128K under any cap from 32 up, and 64 was the
# best cap at batch 1 from 32K to 128K (bench/results/speed_h200.json: the run and its sweep).
# SFI's slow-step kernel picks its own split count (kernels/slow_decode.py); prefill has none.
SFI_TRITON_KV_SPLITS = 64


def has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def dense_backend(cfg: SFIConfig | None = None) -> str:
    """The dense attention backend SFI wraps (cfg.dense_backend, "auto": the platform's,
    which --disable-sfi also uses)."""
    if cfg is not None and cfg.dense_backend != "auto":
        return cfg.dense_backend
    return "triton" if has_gpu() else "torch_native"


# SGLang's CPU engine under tensor or data parallelism (tp x dp x pp ranks > 1):
# - it pins each rank's OpenMP threads to one NUMA node and refuses more ranks than nodes
#   unless SGLANG_CPU_OMP_THREADS_BIND names each rank's cores (sglang/srt/utils/numa_utils.py,
#   init_threads_binding); on a one-node machine the cores are split between the ranks here;
# - its TP group builds a PyNccl communicator whenever libnccl loads, and torch's CUDA wheel
#   ships libnccl, so on a machine without a GPU the group's init fails with "ValueError:
#   Expected a cuda device, but got: cpu" (sglang/srt/distributed/device_communicators/
#   pynccl.py, `with torch.cuda.device(device)`); pointing SGLANG_NCCL_SO_PATH at no library
#   makes PyNccl disable itself (its "missing NCCL library, e.g. in a non-GPU environment"
#   case) and the collectives run on gloo (or SGLang's shared-memory all-reduce where the CPU
#   has AMX). A user's own value of either variable wins.
NO_NCCL = "/nonexistent/sfi-sglang-cpu-engine-has-no-nccl/libnccl.so.2"


def cpu_parallel_args(ranks: int) -> dict[str, Any]:
    """SGLang server arguments for `ranks` (tp x dp x pp) CPU-engine scheduler processes,
    after setting their environment (see above); nothing for one rank or on a GPU machine."""
    if ranks <= 1 or has_gpu():
        return {}
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", NO_NCCL)
    if "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ:
        try:
            from sglang.srt.utils.numa_utils import get_cpu_ids_by_node

            nodes = len(get_cpu_ids_by_node())
        except Exception:  # no NUMA information: SGLang would fail the same way
            nodes = 1
        if ranks > nodes:  # else SGLang's default: one node per rank
            cpus = sorted(os.sched_getaffinity(0))
            per = max(1, len(cpus) // ranks)
            groups = [cpus[(i * per) % len(cpus):(i * per) % len(cpus) + per] for i in range(ranks)]
            os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(
                f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)
    return {"disable_custom_all_reduce": True}  # a GPU all-reduce


def launch_kwargs(kwargs: dict[str, Any], cfg: SFIConfig, enabled: bool) -> dict[str, Any]:
    """SGLang server arguments with our defaults filled in where the user gave none."""
    out = dict(kwargs)
    from sfi_sglang.model import resolve_model_path

    out["model_path"] = resolve_model_path(out.get("model_path"))  # a named model, or the default
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
        # work: sfi_sglang.method.step). Without graphs, per-request options that the device step
        # cannot serve are allowed too (sfi_sglang.method.options.on_device_path).
        from sfi_sglang.method.options import EAGER_ENV, reference_only

        os.environ[EAGER_ENV] = "1" if out.get("disable_cuda_graph") else "0"
        ref_only = ", ".join(reference_only(cfg))
        if ref_only and not out.get("disable_cuda_graph"):
            raise ValueError(f"{ref_only}: the flashinfer fast path runs it only in the torch reference "
                             "(eager decode steps): use --sfi-fast-path triton-pool or triton, add "
                             "--disable-cuda-graph, or leave it at its default")
        cfg = cfg.on_device(has_gpu())  # --sfi-memory-rows auto: 0 on the packed triton path
        if cfg.dense_backend != "auto" and not has_gpu():
            raise ValueError(f"--sfi-dense-backend {cfg.dense_backend} needs a CUDA GPU; the CPU engine "
                             "runs torch_native (leave it at auto)")
        # With --sfi-memory-rows 0 each request slot holds SFI's sparse memory (for Qwen3-4B
        # at the default budget ~2.4 MB of selected positions, ~0.3 GB on the packed `triton`
        # fast path: SparseMemory.footprint); SGLang's default is 2048+ slots. With memory
        # rows a slot costs a few bytes and SGLang's default holds.
        if not cfg.memory_rows:
            out.setdefault("max_running_requests", SFI_MAX_RUNNING_REQUESTS)
        out.setdefault("triton_attention_num_kv_splits", SFI_TRITON_KV_SPLITS)
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
    out = launch_kwargs(kwargs, cfg, enabled=not disable_sfi)
    if not disable_sfi:
        cfg.check_server(int(out.get("tp_size") or 1), out.get("kv_cache_dtype") or "auto")
    ranks = 1
    for key in ("tp_size", "dp_size", "pp_size"):
        ranks *= int(out.get(key) or 1)
    for key, value in cpu_parallel_args(ranks).items():
        out.setdefault(key, value)
    return sglang.Engine(**out)
