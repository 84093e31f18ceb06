"""Kernel warm-up of the `sfi` backend, run once when it is made (CUDA kernel path only).

Compiles the kernels of a prompt's selection and of every kind of decode row (slow: dense
attention with scores and key norms, the Selector, pack; fast; dense; page summaries) before serving.
Otherwise the first request to need each one waits for its compile, seconds each, once per
process (bench/NOTES.md, section 6). No kernel variant follows the batch or the context
(tests/test_kernels.py); what remains is the prompt length modulo 16 (Triton's
specialization) and whether the context fits the budget (top-k takes every key): four
lengths cover them (tests/test_bench.py). Two requests in slots 1 and 2 (SFI on; SFI off: a
dense row) run over the real pools before any request exists: req_to_token's rows are still
zeros, so every position reads KV slot 0 (SGLang's padding slot). The slots are reset
afterwards.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sfi_sglang.integration.slots import Request
from sfi_sglang.method.step import StepMetadata


def warm_up(backend) -> None:
    mem, cfg, sparse = backend.memory, backend.cfg, backend.sparse_ids
    if not mem.packed or not sparse or cfg.method != "sfi" or mem.max_slots < 3:
        return
    num_q_heads = backend.num_q_heads
    k_cache = backend.token_to_kv_pool.get_key_buffer(sparse[0])
    hkv, d, dev, dtype = k_cache.shape[1], k_cache.shape[2], k_cache.device, k_cache.dtype
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=num_q_heads, tp_k_head_num=hkv,
                              qk_head_dim=d, v_head_dim=d, scaling=d ** -0.5)
              # the last one runs the batched Selector; the adaptive trigger's write their LSE
              for i in sorted({sparse[0], sparse[-1], *backend.monitor.layers})]
    width = backend.req_to_token_pool.req_to_token.shape[1]
    long = cfg.memory_tokens() + 32
    lengths = sorted({min(n, width) for n in (511, 496, long - 1, long)})
    zeros = lambda *shape, dt=torch.long: torch.zeros(*shape, dtype=dt, device=dev)
    slots = torch.tensor([1, 2], device=dev)
    try:
        for n in lengths:
            backend.slots.start(1, Request(cfg, True))
            backend.slots.start(2, Request(cfg, False))
            rows = min(cfg.bootstrap_rows, n)  # a prompt's end: selection from its last rows
            ext = SimpleNamespace(extend_start_loc=zeros(1), extend_seq_lens=torch.tensor([rows]),
                                  req_pool_indices=slots[:1].cpu(), seq_lens=torch.tensor([n]))
            backend.bootstrap(zeros(rows, num_q_heads * d, dt=dtype), layers[0], ext)
            backend.step.has_sel[1] = False  # the first decode step: slow (and a dense row)
            fb = SimpleNamespace(out_cache_loc=zeros(2), input_ids=zeros(2), req_pool_indices=slots,
                                 seq_lens=zeros(2) + n, rids=None, forward_mode=ForwardMode.DECODE)
            for _ in range(2):  # slow + dense rows, then fast + dense rows
                backend.begin_decode(fb)
                k = zeros(2, hkv * d, dt=dtype)
                for layer in layers:
                    backend.summarize(layer.layer_id, fb)
                    backend.forward_decode(zeros(2, num_q_heads * d, dt=dtype), k, k, layer, fb,
                                           save_kv_cache=False)
                backend.selection.join()
    finally:
        backend.meta = StepMetadata()
        for slot in (1, 2):
            backend.slots.requests.pop(slot, None)
        mem.reset([1, 2])
        backend.slots.clear_resets()
