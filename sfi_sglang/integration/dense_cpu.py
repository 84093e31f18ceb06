"""The `sfi` backend's dense backend on the CPU engine: SGLang's torch_native backend,
with one change, for extends that continue a cached prefix.

SGLang 0.5.23's `TorchNativeAttnBackend._run_sdpa_forward_extend` runs, for each request,
causal attention over a query as long as the whole context (the prefix rows left
uninitialised) and keeps the last rows: an extend of r rows after a cached prefix of p
tokens costs (p + r)^2 instead of r (p + r). An SFI request extends the radix cache's
prefix by a few rows all the time (multi-turn chat; the eval's runs, each extending the
last rows of a shared prompt), and at 8K this was most of the eval's time: 0.8 s per layer
against 0.02 s. Here such a request's new rows attend with an explicit causal mask
(row i sees positions <= p + i): per row the same reduction over the same keys, so the
same float32 results, to the last bit where torch's CPU kernel blocks the r rows as it
blocks them among p + r (on AVX-512 a row of a short block can round differently;
tests/test_engine.py compares the two on random pools); every other case (no prefix,
sliding windows, encoder or cross attention) is SGLang's own code.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from torch.nn.functional import scaled_dot_product_attention


class PrefixExtendTorchNative(TorchNativeAttnBackend):
    def _run_sdpa_forward_extend(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                 seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None,
                                 scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
                                 sliding_window_size=None):
        plain = (encoder_lens is not None or not causal or is_cross_attn
                 or (sliding_window_size is not None and sliding_window_size > -1))
        if plain or not bool((extend_prefix_lens > 0).any()):
            return super()._run_sdpa_forward_extend(
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                extend_prefix_lens, extend_seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                causal=causal, is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
        q_all = query.movedim(0, query.dim() - 2)  # [heads, tokens, dim]
        start = 0
        for i in range(seq_lens.shape[0]):
            rows, prefix, n = int(extend_seq_lens[i]), int(extend_prefix_lens[i]), int(seq_lens[i])
            q = q_all[:, start:start + rows]
            tokens = req_to_token[req_pool_indices[i], :n]
            key = k_cache[tokens].movedim(0, query.dim() - 2)
            value = v_cache[tokens].movedim(0, query.dim() - 2)
            if not (q.dtype == key.dtype == value.dtype):
                key, value = key.to(q.dtype), value.to(q.dtype)
            if prefix == 0:  # SGLang's own call: the whole context is new
                out = scaled_dot_product_attention(q[None], key[None], value[None], enable_gqa=enable_gqa,
                                                   scale=scaling, is_causal=True)
            else:
                mask = (torch.arange(n, device=q.device)[None, :]
                        <= prefix + torch.arange(rows, device=q.device)[:, None])
                out = scaled_dot_product_attention(q[None], key[None], value[None], attn_mask=mask,
                                                   enable_gqa=enable_gqa, scale=scaling)
            output[start:start + rows] = out[0].movedim(query.dim() - 2, 0)
            start += rows
        return output
