"""SFI kernels (shipped as `sfi_sglang.kernels`).

Triton kernels for the SFI fast and slow decode steps, with float64 torch references that
are also the CPU path. Each public function falls back to its reference when given CPU
tensors outside TRITON_INTERPRET=1, or when Triton is not importable.
"""

from .reference import (ref_dense_decode_with_scores, ref_fast_decode, ref_pack,
                        ref_store_key_norms)

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - triton ships with sglang
    HAS_TRITON = False

if HAS_TRITON:
    from .fast_decode import fast_decode
    from .key_norms import store_key_norms
    from .pack import pack
    from .selector import fused_topk_key
    from .slow_decode import dense_decode, dense_decode_with_scores
    from .topk import topk_positions
else:  # pragma: no cover
    def fast_decode(*args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in ("out",)}
        return ref_fast_decode(*args, **kwargs)

    def dense_decode_with_scores(*args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k in ("out", "scores_out")}
        return ref_dense_decode_with_scores(*args, **kwargs)

    def pack(*args, **kwargs):
        return ref_pack(*args)

    def store_key_norms(*args, **kwargs):
        return ref_store_key_norms(*args)

    dense_decode = None
    fused_topk_key = None
    topk_positions = None

__all__ = [
    "fast_decode", "dense_decode_with_scores", "dense_decode", "pack", "store_key_norms",
    "ref_fast_decode", "ref_dense_decode_with_scores", "ref_pack", "ref_store_key_norms",
    "HAS_TRITON", "fused_topk_key", "topk_positions",
]
