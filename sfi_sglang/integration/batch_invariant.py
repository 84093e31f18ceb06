"""SGLang's --enable-deterministic-inference on the CPU engine: batch-invariant GEMMs.

Why SFI needs it: a request's slow steps pick K positions by a top-k over attention scores,
a discrete choice. On the CPU, torch's GEMM gives a row a result that depends on how many
rows the GEMM has: below 16 rows it takes another code path (a row differs by ~4e-5 between
a 1-row and a 32-row product of the same weights). That is the same float noise that leaves
dense decoding's tokens equal alone and in a batch, but when it moves two candidates' scores
across the K-th place, the selection changes, and the request's tokens with it.

SGLang's own batch-invariant mode (sglang.srt.batch_invariant_ops) is Triton code for GPUs
and raises on the CPU ("No supported accelerator"). Here the CPU kernels of aten::mm and
aten::addmm are replaced, in the scheduler process, by the same GEMM with its rows padded to
MIN_ROWS: every row then takes the path that larger GEMMs take, where a row's result does
not depend on the other rows (tests/test_batching.py checks both facts). The cost is a GEMM
of 16 rows for decode batches below 16 (measured on 2 cores: up to ~5x on SmolLM2's
vocabulary projection at batch 1). The rest of the CPU decode step is per row already:
RMSNorm, rotary, SGLang's torch_native attention (one SDPA per request) and SFI's own
torch path (row-wise scores; the Selector's reductions do not change with trailing -inf
padding).
"""

from __future__ import annotations

import torch

MIN_ROWS = 16
_LIB = None


def _rows(a: torch.Tensor) -> tuple[torch.Tensor, int]:
    m = a.shape[0]
    if m >= MIN_ROWS:
        return a, m
    return torch.cat([a, a.new_zeros(MIN_ROWS - m, a.shape[1])]), m


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, m = _rows(a)
    out = a.new_empty(a.shape[0], b.shape[1])
    torch.ops.aten.mm.out(a, b, out=out)  # the native kernel: .out is not replaced
    return out[:m]


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    a, m = _rows(a)
    out = a.new_empty(a.shape[0], b.shape[1])
    bias = bias.expand(a.shape[0], b.shape[1]) if bias.dim() < 2 or bias.shape[0] == 1 else \
        torch.cat([bias, bias.new_zeros(a.shape[0] - m, bias.shape[1])])
    torch.ops.aten.addmm.out(bias, a, b, beta=beta, alpha=alpha, out=out)
    return out[:m]


def enable() -> None:
    """Replace the CPU kernels of aten::mm and aten::addmm in this process (idempotent)."""
    global _LIB
    if _LIB is not None:
        return
    _LIB = torch.library.Library("aten", "IMPL")
    _LIB.impl("aten::mm", mm, "CPU")
    _LIB.impl("aten::addmm", addmm, "CPU")


def disable() -> None:
    """Give aten::mm and aten::addmm their CPU kernels back (tests)."""
    global _LIB
    if _LIB is not None:
        _LIB._destroy()
        _LIB = None


def register_backend_choices() -> None:
    """The `sfi` backend may run under --enable-deterministic-inference (SGLang checks the
    attention backend against its list). It is not added to the list of backends whose
    output is the same with and without a radix-cache hit: a request that starts from a
    shared prefix's SFI memory selects from that memory, not from its own bootstrap, so
    SGLang turns the radix cache off in this mode, as it does for its other such backends."""
    from sglang.srt.arg_groups.choices import (
        DETERMINISTIC_ATTENTION_BACKEND_CHOICES, add_deterministic_attention_backend_choices)

    if "sfi" not in DETERMINISTIC_ATTENTION_BACKEND_CHOICES:
        add_deterministic_attention_backend_choices(["sfi"])
