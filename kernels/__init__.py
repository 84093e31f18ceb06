"""SFI kernels (shipped as `sfi_sglang.kernels`; imported only that way).

Triton kernels for the SFI fast and slow decode steps, with float64 torch references that
are also the CPU path. Each public function falls back to its reference when given CPU
tensors outside TRITON_INTERPRET=1. The Triton modules are imported on first use
(PEP 562), so `from sfi_sglang.kernels import reference` never imports Triton: the CPU
path leaves TRITON_INTERPRET unfixed for the rest of the process.
"""

import importlib

from .reference import (ref_dense_decode_with_scores, ref_fast_decode, ref_pack,  # noqa: F401
                        page_bounds, extra_positions, ref_page_scores,
                        ref_drop_held, ref_summarize_pages, summary_bounds)

# public name -> the submodule that defines it
_LAZY = {
    "fast_decode": "fast_decode", "pack": "pack",
    "store_selection": "pack",
    "fused_topk_key": "selector", "dense_decode": "slow_decode",
    "dense_decode_with_scores": "slow_decode", "topk_positions": "topk",
    "set_batch_invariant": "_common", "page_scores": "topup", "choose_pages": "topup",
    "choose_topup": "topup", "drop_held": "topup", "pick_pages": "topup", "summarize_pages": "topup",
}


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        # every public name of that submodule at once: importing it binds the submodule to
        # the package attribute of its own name (pack, fast_decode), which must stay the function
        for other, mod in _LAZY.items():
            if mod == _LAZY[name]:
                globals()[other] = getattr(module, other)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_LAZY, "ref_fast_decode", "ref_dense_decode_with_scores", "ref_pack",
           "page_bounds", "extra_positions", "ref_page_scores", "ref_drop_held", "ref_summarize_pages",
           "summary_bounds"]
