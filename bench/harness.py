"""The bench harness (`python bench/harness.py`): decode tokens/s, SFI vs dense, on a
Qwen3-4B-shaped model with dummy (random) weights, at long contexts. Not part of the package.

Real SGLang cannot run on the GPU machine we measure on (bench/NOTES.md, "End to end":
its import pulls ~150 packages and its CUDA layers need sgl_kernel's CUDA ops), so this is
the harness this project allows: SGLang's memory layout (a req_to_token table and per-layer
token-slot K/V buffers [slots, H_kv, D]), SGLang's method names (init_forward_metadata,
forward_decode(q, k, v, layer, forward_batch)), and the product's own `sfi` backend
(sfi_sglang.integration.backend.SFIAttnBackend: plan, SparseMemory, kernels, Selector) driven by a
plain-torch decoder. The dense baseline is the same paged flash-decoding Triton kernel the
slow steps use (kernels.dense_decode, SGLang's triton-backend design), so dense and SFI
share every non-attention op.

Steps: every decode step of the model (embedding to greedy argmax) is one CUDA graph; for
SFI one graph serves every step, fast or slow, as in SGLang's graph runner: the device-side
step plan (sfi_sglang.method.step) decides the rows inside it and a conditional node runs the slow
pass only when some row needs it. Random
weights make boundaries meaningless, so SFI refreshes every `--slow-every` steps
(`refresh="interval"`): a realistic rate of one slow step per ~24 tokens. The prompt's K/V
are random values written straight into the pools (no prefill); a request's first decode
step is a slow step (it has no selection yet) and is not timed.

The ideal bound comes from parts measured in the same run: the step without attention,
the dense attention of all layers, the fast attention, and the slow-step attention:
ideal SFI step = none + (1 - r) * fast_attn + r * slow_attn, r = 1 / slow_every.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch

from sfi_sglang.integration import state
from sfi_sglang.integration.backend import SFIAttnBackend
from sfi_sglang.method.config import FAST_PATHS, SFIConfig, export_config
from sfi_sglang.method.memory import NO_WINDOW
from sfi_sglang.method.step import ScoreBuffers, score_rows

SHAPES = {
    # Qwen3-4B: 36 layers, hidden 2560, 32 query / 8 KV heads of 128, MLP 9728
    "qwen3-4b": dict(layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, inter=9728,
                     vocab=151936, qk_norm=True),
    # a tiny shape for CPU smoke tests
    "tiny": dict(layers=4, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=512,
                 qk_norm=True),
}


# ---------------------------------------------------------------------- SGLang-layout pools
class ReqToTokenPool:
    """SGLang's ReqToTokenPool layout: req_to_token [slots + 1, max_context] int32 (row 0 is
    SGLang's padding row)."""

    def __init__(self, size: int, max_context: int, device):
        self.req_to_token = torch.zeros(size + 1, max_context, dtype=torch.int32, device=device)
        self._on_alloc_rows = None

    def register_on_alloc_rows(self, hook):
        self._on_alloc_rows = hook


class TokenToKVPool:
    """SGLang's MHATokenToKVPool layout: per layer K and V [tokens + 1, H_kv, D]."""

    def __init__(self, tokens: int, layers: int, kv_heads: int, head_dim: int, dtype, device):
        shape = (tokens + 1, kv_heads, head_dim)
        self.size = tokens  # SGLang's: the tokens it holds (+ 1 padding slot in the buffers)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(layers)]

    def get_key_buffer(self, layer_id):
        return self.k[layer_id]

    def get_value_buffer(self, layer_id):
        return self.v[layer_id]

    def set_kv_buffer(self, layer, loc, k, v):
        loc = getattr(loc, "loc", loc)  # SGLang's KVWriteLoc (the `sfi` backend) or the indices
        put(self.k[layer.layer_id], loc, k.view(-1, *self.k[0].shape[1:]))
        put(self.v[layer.layer_id], loc, v.view(-1, *self.v[0].shape[1:]))


def put(buf: torch.Tensor, loc, x: torch.Tensor) -> None:
    """buf[loc] = x in buf's dtype; an fp8 buffer through its bytes, as SGLang's pool stores
    fp8 (index_put has no fp8 kernel everywhere)."""
    if buf.element_size() == 1 and buf.is_floating_point():
        buf.view(torch.uint8)[loc] = x.to(buf.dtype).view(torch.uint8)
    else:
        buf[loc] = x.to(buf.dtype)


@dataclass
class Mode:
    decode: bool

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode

    def is_mixed(self):
        return False


@dataclass
class Batch:
    """The ForwardBatch fields the backends read (static tensors, updated in place)."""

    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    input_ids: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    rids: list
    forward_mode: Mode = field(default_factory=lambda: Mode(True))
    sampling_info: object = None
    extend_prefix_lens_cpu: Optional[list] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_start_loc: Optional[torch.Tensor] = None


class DenseBackend:
    """The dense baseline: paged flash-decoding through req_to_token (kernels.dense_decode,
    the torch reference off CUDA)."""

    def __init__(self, req_to_token_pool, kv_pool, max_len: int):
        from sfi_sglang import kernels

        self.r2t = req_to_token_pool.req_to_token
        self.kv = kv_pool
        self.max_len = max_len
        self.k = kernels

    def init_forward_metadata(self, forward_batch):
        pass

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass

    def init_forward_metadata_in_graph(self, forward_batch):
        pass

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        pass

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        if save_kv_cache:
            self.kv.set_kv_buffer(layer, fb.out_cache_loc, k, v)
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        kc, vc = self.kv.get_key_buffer(layer.layer_id), self.kv.get_value_buffer(layer.layer_id)
        if q.is_cuda:
            o = self.k.dense_decode(q, kc, vc, self.r2t, fb.req_pool_indices, fb.seq_lens,
                                    layer.scaling, max_len=self.max_len)
        else:
            o, _ = self.k.ref_dense_decode_with_scores(q, kc, vc, self.r2t, fb.req_pool_indices,
                                                       fb.seq_lens, layer.scaling,
                                                       compute_dtype=torch.float32)
            o = o.to(q.dtype)
        return o.reshape(q.shape[0], -1)


# ---------------------------------------------------------------------- the model
def _rms(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class DummyModel:
    """A Qwen3- or Llama-shaped decoder (RMSNorm, QKV, optional q/k norm, RoPE, attention
    through a backend, O, SwiGLU MLP, LM head, greedy) with random weights, or real ones
    (DummyModel.from_hf: a Hugging Face Llama checkpoint, e.g. SmolLM2).

    Shape keys: layers, hidden, heads, kv_heads, head_dim, inter, vocab; optional qk_norm
    (default True), rope_theta (1e6), eps (RMSNorm, 1e-6), tied (LM head = embedding, False)."""

    def __init__(self, shape: dict, dtype, device, seed: int = 0, weights: Optional[dict] = None):
        g = torch.Generator(device=device).manual_seed(seed)
        s = SimpleNamespace(**{"qk_norm": True, "rope_theta": 1e6, "eps": 1e-6, "tied": False, **shape})
        self.s = s
        H, Hk, D, E, I = s.heads, s.kv_heads, s.head_dim, s.hidden, s.inter

        def w(*shape_, std=None):
            std = std if std is not None else 1.0 / math.sqrt(shape_[-1])
            return torch.empty(*shape_, dtype=torch.float32, device=device).normal_(
                0, std, generator=g).to(dtype)

        if weights is not None:  # HF names -> tensors (see from_hf)
            def hf(name):
                return weights[name].to(device=device, dtype=dtype).contiguous()
        self.embed = hf("model.embed_tokens.weight") if weights is not None else w(s.vocab, E, std=1.0)
        if s.tied:
            self.lm_head = self.embed
        else:
            self.lm_head = hf("lm_head.weight") if weights is not None else w(s.vocab, E)
        self.norm = hf("model.norm.weight") if weights is not None else torch.ones(E, dtype=dtype, device=device)
        self.layers = []
        for i in range(s.layers):
            attn = SimpleNamespace(layer_id=i, tp_q_head_num=H, tp_k_head_num=Hk, qk_head_dim=D,
                                   v_head_dim=D, scaling=D ** -0.5)
            if weights is not None:
                p = f"model.layers.{i}."
                a, m = p + "self_attn.", p + "mlp."
                self.layers.append(SimpleNamespace(
                    qkv=torch.cat([hf(a + "q_proj.weight"), hf(a + "k_proj.weight"), hf(a + "v_proj.weight")]),
                    o=hf(a + "o_proj.weight"),
                    gate_up=torch.cat([hf(m + "gate_proj.weight"), hf(m + "up_proj.weight")]),
                    down=hf(m + "down_proj.weight"),
                    ln1=hf(p + "input_layernorm.weight"), ln2=hf(p + "post_attention_layernorm.weight"),
                    qn=hf(a + "q_norm.weight") if s.qk_norm else None,
                    kn=hf(a + "k_norm.weight") if s.qk_norm else None, attn=attn))
                continue
            self.layers.append(SimpleNamespace(
                qkv=w((H + 2 * Hk) * D, E), o=w(E, H * D), gate_up=w(2 * I, E), down=w(E, I),
                ln1=torch.ones(E, dtype=dtype, device=device), ln2=torch.ones(E, dtype=dtype, device=device),
                qn=torch.ones(D, dtype=dtype, device=device), kn=torch.ones(D, dtype=dtype, device=device),
                attn=attn))
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        self.inv_freq = inv.to(device)

    @staticmethod
    def hf_shape(config: dict) -> dict:
        """The shape dict of a Hugging Face Llama/Qwen3 config.json (plain default RoPE only)."""
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or {}
        kind = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if kind != "default":
            raise ValueError(f"unsupported RoPE type {kind!r}")
        heads = config["num_attention_heads"]
        return dict(layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
                    kv_heads=config.get("num_key_value_heads", heads),
                    head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                    inter=config["intermediate_size"], vocab=config["vocab_size"],
                    qk_norm=config.get("model_type") == "qwen3",
                    rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
                    eps=float(config.get("rms_norm_eps", 1e-6)),
                    tied=bool(config.get("tie_word_embeddings", False)))

    @classmethod
    def from_hf(cls, config: dict, files, dtype, device) -> "DummyModel":
        """Real weights: config.json's dict and the checkpoint's .safetensors files (all its
        shards, or any split of its tensors over several files)."""
        from safetensors.torch import load_file

        weights = {}
        for f in files:
            weights.update(load_file(str(f)))
        return cls(cls.hf_shape(config), dtype, device, weights=weights)

    def _rope(self, x, pos):
        # x [B, h, D], pos [B]: neox-style rotation (HF Llama's rotate_half)
        f = pos.float()[:, None] * self.inv_freq[None]  # [B, D/2]
        cos, sin = f.cos()[:, None, :], f.sin()[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def _qkv(self, L, h, pos):
        s = self.s
        T = h.shape[0]
        H, Hk, D = s.heads, s.kv_heads, s.head_dim
        x = _rms(h, L.ln1, s.eps)
        q, k, v = (x @ L.qkv.T).split([H * D, Hk * D, Hk * D], dim=-1)
        q, k = q.reshape(T, H, D), k.reshape(T, Hk, D)
        if s.qk_norm:
            q, k = _rms(q, L.qn, s.eps), _rms(k, L.kn, s.eps)
        return self._rope(q, pos), self._rope(k, pos), v.reshape(T, Hk, D)

    def _mlp(self, L, h):
        gate, up = (_rms(h, L.ln2, self.s.eps) @ L.gate_up.T).chunk(2, dim=-1)
        return h + (torch.nn.functional.silu(gate) * up) @ L.down.T

    def _logits(self, h):
        return _rms(h, self.norm, self.s.eps) @ self.lm_head.T

    def step(self, backend, fb: Batch, attention: bool = True, return_logits: bool = False) -> torch.Tensor:
        """One decode step for the batch; returns the greedy next ids [B] (or the logits
        [B, V]). Ends by joining the backend's side stream (asynchronous maintenance), so a
        captured step does."""
        B = fb.input_ids.shape[0]
        h = self.embed[fb.input_ids]
        for L in self.layers:
            q, k, v = self._qkv(L, h, fb.positions)
            if attention:
                o = backend.forward_decode(q.reshape(B, -1), k, v, L.attn, fb)
            else:
                o = q.reshape(B, -1)
            h = self._mlp(L, h + o @ L.o.T)
        logits = self._logits(h)
        if backend is not None and hasattr(backend, "selection"):
            backend.selection.join()
        return logits if return_logits else logits.argmax(-1)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, all_logits: bool = False):
        """A real prefill of one prompt ids [T] (causal attention in torch, no pools): per
        layer K (after RoPE) and V [T, H_kv, D], and the logits of the last position [V]
        (all positions [T, V] with all_logits). See Setup.write_prompt."""
        s = self.s
        T = ids.shape[0]
        pos = torch.arange(T, device=ids.device)
        h = self.embed[ids]
        ks, vs = [], []
        rep = s.heads // s.kv_heads
        for L in self.layers:
            q, k, v = self._qkv(L, h, pos)
            ks.append(k)
            vs.append(v)
            kk, vv = (t.repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))  # [H, T, D]
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), kk, vv, is_causal=True, scale=L.attn.scaling)
            h = self._mlp(L, h + o.transpose(0, 1).reshape(T, -1) @ L.o.T)
        logits = self._logits(h if all_logits else h[-1:])
        return ks, vs, (logits if all_logits else logits[0])


def tokenizer_dir() -> str:
    """A tokenizer folder for the backend's boundary table (replaced by an empty one here):
    $SFI_TOKENIZER_DIR (the GPU machine's copy, bench/sglang_h200.sh), else the embedded model's."""
    import os

    path = os.environ.get("SFI_TOKENIZER_DIR")
    if path:
        return path
    from sfi_sglang.model import default_model_path

    return default_model_path()


# ---------------------------------------------------------------------- one configuration
class Setup:
    """Pools, a batch of B requests of context n, and both backends."""

    def __init__(self, model: DummyModel, cfg: SFIConfig, n: int, batch: int, steps: int, device, dtype,
                 packed: Optional[bool] = None, all_slow: bool = True, kv_dtype=None):
        s = model.s
        if all_slow:  # every row may be slow at once (cfg.max_slow_rows 0): the requests run
            # in lockstep, and the slow parts time the whole batch slow
            cfg = cfg.replace(max_slow_rows=0)
        if cfg.memory_rows == "auto":  # the harness's requests are its slots, each with a memory
            cfg = cfg.replace(memory_rows=0)
        self.model, self.n, self.B, self.steps = model, n, batch, steps
        cap = n + steps + 8
        self.cap = cap
        self.r2t_pool = ReqToTokenPool(batch, cap, device)
        self.kv = TokenToKVPool(batch * cap, s.layers, s.kv_heads, s.head_dim, kv_dtype or dtype, device)
        slots = torch.arange(1, batch + 1, device=device)
        base = 1 + (slots - 1) * cap  # request b's tokens are [base_b, base_b + cap)
        self.r2t_pool.req_to_token[1:batch + 1] = (base[:, None] + torch.arange(cap, device=device)).int()
        self.base = base
        self.fb = Batch(req_pool_indices=slots, seq_lens=torch.full((batch,), n, device=device),
                        input_ids=torch.zeros(batch, dtype=torch.int64, device=device),
                        out_cache_loc=base + n - 1, positions=torch.full((batch,), n - 1, device=device),
                        rids=[f"r{b}" for b in range(batch)])
        self.dense = DenseBackend(self.r2t_pool, self.kv, cap)
        runner = SimpleNamespace(device=torch.device(device), req_to_token_pool=self.r2t_pool,
                                 token_to_kv_pool=self.kv,
                                 model_config=SimpleNamespace(num_hidden_layers=s.layers, vocab_size=s.vocab,
                                                              num_attention_heads=s.heads),
                                 server_args=SimpleNamespace(tokenizer_path=tokenizer_dir(), model_path=None,
                                                             trust_remote_code=False, tp_size=1))
        export_config(cfg)
        self.sfi = SFIAttnBackend(runner, self.dense)
        # random weights make boundaries meaningless: no boundary token, every token content
        # (slow steps come every --slow-every steps, refresh "interval")
        self.sfi.install_boundaries(torch.zeros(s.vocab, dtype=torch.bool), torch.ones(s.vocab, dtype=torch.bool),
                                    spec="none", version=0)
        if packed is not None and packed != self.sfi.memory.packed:
            # the kernel path on CPU tensors (tests, under TRITON_INTERPRET=1): the same memory
            # object re-made in place, so every part of the backend holding it sees it
            m = self.sfi.memory
            m.__init__(m.num_layers, m.sparse_layer_ids, m.max_slots, m.num_kv_heads, m.head_dim, cfg,
                       m.device, m.dtype, packed=packed, rows=m.rows.count)
            m.fast_ws[0] = NO_WINDOW  # SGLang's padding slot, as the backend sets it
            sc = self.sfi.scores  # and the score buffers of that path
            self.sfi.scores = ScoreBuffers(m.device, packed, score_rows(m.max_slots, cfg.max_slow_rows,
                                                                      cfg.memory_rows),
                                           sc.num_sparse, sc.num_q_heads, sc.num_kv_heads, sc.width,
                                           batched=cfg.method == "sfi")
        self.sfi.init_cuda_graph_state(batch, batch)  # as SGLang's graph runner does
        self.fill(seed=1)

    def fill(self, seed: int):
        """Random prompt K/V for positions [0, n - 1) of every request."""
        g = torch.Generator(device=self.fb.seq_lens.device).manual_seed(seed)
        locs = (self.base[:, None] + torch.arange(self.n - 1, device=self.base.device)).reshape(-1)
        for k, v in zip(self.kv.k, self.kv.v):
            shape = (locs.numel(), *k.shape[1:])
            kk = torch.randn(shape, generator=g, device=k.device, dtype=torch.float32).to(k.dtype)
            put(k, locs, kk)
            put(v, locs, torch.randn(shape, generator=g, device=v.device, dtype=torch.float32))
            del kk

    def write_prompt(self, ks, vs):
        """Real prompt K/V (DummyModel.prefill of the prompt's first n - 1 tokens: per layer
        [n - 1, H_kv, D]) into every request's slots."""
        locs = (self.base[:, None] + torch.arange(self.n - 1, device=self.base.device)).reshape(-1)
        for lid, (k, v) in enumerate(zip(self.kv.k, self.kv.v)):
            kk = ks[lid].to(k.dtype).repeat(self.B, 1, 1)
            put(k, locs, kk)
            put(v, locs, vs[lid].repeat(self.B, 1, 1))

    def reset(self, first_ids: torch.Tensor):
        """Every request back at context n (its last prompt token as input), SFI memory
        empty: the next SFI decode step is each request's first, a slow step."""
        fb = self.fb
        fb.seq_lens.fill_(self.n)
        fb.positions.fill_(self.n - 1)
        fb.out_cache_loc.copy_(self.base + self.n - 1)
        fb.input_ids.copy_(first_ids)
        slots = fb.req_pool_indices.tolist()
        self.sfi.slots.on_alloc_rows(slots)
        ext = Batch(req_pool_indices=fb.req_pool_indices, seq_lens=fb.seq_lens, input_ids=fb.input_ids,
                    out_cache_loc=fb.out_cache_loc, positions=fb.positions, rids=fb.rids,
                    forward_mode=Mode(False), extend_prefix_lens_cpu=[0] * self.B)
        self.sfi.slots.start_requests(ext)

    def advance(self, next_ids: torch.Tensor):
        fb = self.fb
        fb.input_ids.copy_(next_ids)
        fb.seq_lens.add_(1)
        fb.positions.add_(1)
        fb.out_cache_loc.add_(1)


def _graph(fn, warmup: int = 2):
    """CUDA graph of fn() (whose inputs are static tensors); returns (graph, output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def rounding_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of x's dtype at |x| (float32): 2^(exponent - mantissa bits)."""
    mant = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[x.dtype]
    _, e = torch.frexp(x.float().abs().clamp_min(torch.finfo(torch.float32).tiny))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 1 - mant)


class Runner:
    """Decode loops of one Setup: dense, SFI, and the parts of the ideal bound."""

    def __init__(self, st: Setup, use_graphs: bool):
        self.st = st
        self.graphs = use_graphs and st.fb.seq_lens.is_cuda
        self.cuda = st.fb.seq_lens.is_cuda
        self._dense_g = None
        self._sfi_graph = None  # (graph, output ids) of one SFI step

    def _timer(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _elapsed(self, a, b) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a

    # -------------------------------------------------------------- dense
    def run_dense(self, first_ids, steps):
        st, m = self.st, self.st.model
        st.reset(first_ids)
        step = lambda: m.step(st.dense, st.fb)
        if self.graphs and self._dense_g is None:
            self._dense_g = _graph(step)
            st.reset(first_ids)
        out = []
        t0 = self._timer()
        for _ in range(steps):
            if self.graphs:
                self._dense_g[0].replay()
                nxt = self._dense_g[1]
            else:
                nxt = step()
            out.append(nxt.clone())
            st.advance(nxt)
        t1 = self._timer()
        return torch.stack(out, 1), self._elapsed(t0, t1)

    # -------------------------------------------------------------- SFI
    def run_sfi(self, first_ids, steps, forced=None, gaps=False):
        """First step (the bootstrap-less first selection) untimed, then `steps` timed.
        forced [B, steps + 1]: after step k feed forced[:, k], not the token picked
        (teacher forcing: the picks then say what this path chooses on that history).
        gaps (eager runs, with forced): self.gaps [B, steps + 1] is, at each step, this
        path's logit of its pick less its logit of forced[:, k], in units of the logits'
        rounding step there (their dtype's spacing at the pick's logit): 0 where both pick
        the same; a pick that differs by a few units is a near tie that summation order
        alone can turn. self.margins: the top two logits' gap in the same units."""
        st, m, be = self.st, self.st.model, self.st.sfi
        feed = (lambda k, nxt: nxt) if forced is None else (lambda k, nxt: forced[:, k])
        assert not gaps or (forced is not None and not self.graphs), "gaps: an eager, forced run"
        st.reset(first_ids)
        out, gap, margin = [], [], []

        def slow_count():
            return int(be.memory.counts[st.fb.req_pool_indices, 1].sum())

        def one():
            # SGLang's protocol: the host part outside the graph, the step plan and the
            # model inside it; one graph serves any mix of fast, slow and dense rows
            be.init_forward_metadata_out_graph(st.fb)
            if not self.graphs:
                be.init_forward_metadata_in_graph(st.fb)
                if not gaps:
                    return m.step(be, st.fb)
                logits = m.step(be, st.fb, return_logits=True)
                pick = logits.argmax(-1)
                top = logits.gather(1, pick[:, None])[:, 0]
                theirs = logits.gather(1, forced[:, len(out)][:, None])[:, 0]
                unit = rounding_step(top)
                gap.append(((top - theirs).float() / unit).cpu())
                two = logits.topk(2, -1).values
                margin.append(((two[:, 0] - two[:, 1]).float() / unit).cpu())
                return pick
            if self._sfi_graph is None:
                self._sfi_graph = self._capture()
            graph, out_ids = self._sfi_graph
            graph.replay()
            return out_ids

        nxt = one()  # first decode step: every request selects (slow)
        out.append(nxt.clone())
        st.advance(feed(0, nxt))
        slow0 = slow_count()
        t0 = self._timer()
        for k in range(steps):
            nxt = one()
            out.append(nxt.clone())
            st.advance(feed(k + 1, nxt))
        t1 = self._timer()
        slow_steps = (slow_count() - slow0) // max(1, st.B)
        self.gaps = torch.stack(gap, 1) if gaps else None
        self.margins = torch.stack(margin, 1) if gaps else None
        return torch.stack(out, 1), self._elapsed(t0, t1), slow_steps

    def _capture(self):
        """A graph of one SFI step (step plan + model); the batch's tensors and the step
        plan's state are restored after the warm-up runs."""
        st, m, be = self.st, self.st.model, self.st.sfi
        fb = st.fb
        live = (fb.seq_lens, fb.positions, fb.out_cache_loc, fb.input_ids)
        state = (be.step.steps, be.step.slow_n, be.step.slow_log, be.step.has_sel, be.memory.counts,
                 be.policy.since, be.policy.pending, be.policy.deferred)
        saved = [t.clone() for t in live + state]

        def step():
            be.init_forward_metadata_in_graph(fb)
            return m.step(be, fb)

        graph = _graph(step)
        for t, v in zip(live + state, saved):
            t.copy_(v)
        return graph

    # -------------------------------------------------------------- parts
    def time_parts(self, first_ids, reps: int, layers_too: bool = False):
        """Seconds per step: the model without attention; attention alone (all layers) for
        dense, SFI fast and SFI slow steps at the current contexts. layers_too: also one
        sparse layer as the backend runs it at a fast and at a slow step, and SDPA."""
        st, m, be = self.st, self.st.model, self.st.sfi
        s = m.s
        B = st.B
        dev = st.fb.seq_lens.device
        dt = st.kv.k[0].dtype
        q = torch.randn(B, s.heads * s.head_dim, device=dev, dtype=torch.float32).to(dt)
        k = torch.randn(B, s.kv_heads, s.head_dim, device=dev, dtype=torch.float32).to(dt)
        v = torch.randn_like(k)
        attn = [L.attn for L in m.layers]

        def none():
            return m.step(None, st.fb, attention=False)

        def dense_attn():
            for a in attn:
                st.dense.forward_decode(q, k, v, a, st.fb)

        def sfi_attn():
            for a in attn:
                be.forward_decode(q, k, v, a, st.fb)

        res = {}
        st.reset(first_ids)
        be.init_forward_metadata(st.fb)  # the first step selects (no selection yet)
        st.advance(m.step(be, st.fb))
        be.init_forward_metadata(st.fb)  # then a fast step (interval >= 2)
        assert not bool(be.meta.rows.slow.any())
        last = attn[-1]
        kc, vc = st.kv.get_key_buffer(last.layer_id), st.kv.get_value_buffer(last.layer_id)
        q3 = q.view(B, s.heads, s.head_dim)

        def fast_layer():  # one sparse layer's fast attention alone (SparseMemory -> kernel)
            be.memory.attend_fast(last.layer_id, q3, kc, vc, st.r2t_pool.req_to_token,
                                  st.fb.req_pool_indices, st.fb.seq_lens, last.scaling)

        sfi_layer = lambda: be.forward_decode(q, k, v, last, st.fb)  # noqa: E731
        sparse = last.layer_id not in be.cfg.dense_layers
        parts = [("none", none), ("dense_attn", dense_attn), ("fast_attn", sfi_attn),
                 ("dense_layer", lambda: st.dense.forward_decode(q, k, v, last, st.fb)),
                 ("fast_layer", fast_layer)]
        if layers_too and sparse:
            # the backend's whole layer (key norms, K/V save, fast kernel, the IF node's
            # predicate), and PyTorch's SDPA over a contiguous copy of the layer's K/V: the
            # best dense decode kernel on the GPU machine (no FlashInfer there)
            idx = st.r2t_pool.req_to_token[st.fb.req_pool_indices, :st.n].long()
            kd, vd = (x[idx].permute(0, 2, 1, 3).contiguous() for x in (kc, vc))
            qd = q3[:, :, None, :]
            parts += [("sfi_fast_layer", sfi_layer),
                      ("sdpa_layer", lambda: torch.nn.functional.scaled_dot_product_attention(
                          qd, kd, vd, scale=last.scaling, enable_gqa=True))]
        for name, fn in parts:
            res[name] = self._time(fn, reps)
        if layers_too and sparse:
            del kd, vd
        # slow attention: every row slow (forced)
        be.policy.since[st.fb.req_pool_indices] = be.policy.max_interval[st.fb.req_pool_indices]
        be.init_forward_metadata(st.fb)
        assert bool(be.meta.rows.slow.all())
        res["slow_attn"] = self._time(sfi_attn, reps)
        if layers_too and sparse:  # one layer's whole slow pass (dense + scores, Selector, store)
            res["sfi_slow_layer"] = self._time(sfi_layer, reps)
        return res

    def _time(self, fn, reps):
        if self.graphs:
            g, _ = _graph(fn)
            fn = g.replay
        else:
            fn()
        ts = []
        for _ in range(reps):
            a = self._timer()
            fn()
            b = self._timer()
            ts.append(self._elapsed(a, b))
        ts.sort()
        return ts[len(ts) // 2]


# ---------------------------------------------------------------------- the command
def throughput(args) -> dict:
    try:
        from tqdm import tqdm
    except ImportError:  # the GPU machine may lack it
        def tqdm(it, **_):
            return it
        tqdm.write = print

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    shape = SHAPES[args.shape]
    cfg = SFIConfig(budget=args.sfi_budget, window=args.sfi_window, sinks=args.sfi_sinks,
                    dense_layers=tuple(int(x) for x in args.sfi_dense_layers.split(",") if x != ""),
                    refresh=args.sfi_refresh, adaptive_threshold=args.sfi_adaptive_threshold,
                    max_interval=args.slow_every, fast_path=args.sfi_fast_path,
                    min_gap=min(SFIConfig.min_gap, args.slow_every))
    if args.layers:
        shape = dict(shape, layers=args.layers)
    model = DummyModel(shape, dtype, device)
    configs = [tuple(int(x) for x in item.split("x")) for item in args.configs.split(",")]
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for n, b in tqdm(configs, desc="contexts x batch", unit="config"):
        st = Setup(model, cfg, n, b, args.steps + 2, device, dtype)
        run = Runner(st, not args.no_cuda_graph)
        first = torch.randint(0, shape["vocab"], (b,), generator=g).to(device)
        if args.parts_only:
            parts = run.time_parts(first, args.reps, layers_too=True)
            row = {"context": n, "batch": b, "parts_ms": {k: v * 1e3 for k, v in parts.items()}}
        else:
            row = _decode_row(args, cfg, run, first, n, b)
        _layer_ratios(row)
        rows.append(row)
        tqdm.write(json.dumps(_rounded(row)))
        state.BACKENDS.remove(st.sfi)
        del st, run
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return {"shape": args.shape, "layers": shape["layers"], "dtype": args.dtype, "device": torch.cuda.get_device_name() if
            device == "cuda" else "cpu", "config": cfg.to_dict(), "slow_every": args.slow_every,
            "cuda_graphs": not args.no_cuda_graph, "async_maintenance": args.async_maintenance,
            "rows": rows}


def _decode_row(args, cfg, run, first, n: int, b: int) -> dict:
    """One configuration's decode loops (dense, SFI, optionally asynchronous maintenance) and
    parts: its result row."""
    st = run.st
    dense_ids, t_dense = run.run_dense(first, args.steps)
    run.run_sfi(first, args.steps)  # warm-up: Triton compiles slow-step variants (N mod 16)
    sfi_ids, t_sfi, n_slow = run.run_sfi(first, args.steps)
    async_row = {}
    if args.async_maintenance:
        st.sfi.selection.enable_async()
        arun = Runner(st, not args.no_cuda_graph)
        arun.run_sfi(first, args.steps)
        a_ids, t_async, _ = arun.run_sfi(first, args.steps)
        st.sfi.selection.enable_async(False)
        async_row = {"sfi_async_tok_s": b * args.steps / t_async,
                     "async_saved_ms_per_step": (t_sfi - t_async) / args.steps * 1e3,
                     "async_tokens_equal_sync": bool(torch.equal(a_ids, sfi_ids))}
        del arun
    parts = run.time_parts(first, args.reps, layers_too=args.layer_parts)
    r = 1.0 / args.slow_every
    ideal_sfi = parts["none"] + (1 - r) * parts["fast_attn"] + r * parts["slow_attn"]
    dense_step = t_dense / args.steps
    sfi_step = t_sfi / args.steps
    row = {
        "context": n, "batch": b, "steps": args.steps,
        "dense_tok_s": b / dense_step, "sfi_tok_s": b / sfi_step,
        "speedup": dense_step / sfi_step,
        "slow_steps": n_slow, "slow_rate": n_slow / args.steps,
        "parts_ms": {k: v * 1e3 for k, v in parts.items()},
        "ideal_speedup": dense_step / ideal_sfi,
        "fraction_of_ideal": ideal_sfi / sfi_step,
        "dense_step_ms": dense_step * 1e3, "sfi_step_ms": sfi_step * 1e3,
        # tokens equal while every context fits S + W + K (then SFI attends to everything)
        "fits_budget": n + args.steps + 1 <= cfg.sinks + cfg.window + cfg.budget,
        # same start, same greedy tokens? (exact in fp32 when the contexts fit the budget;
        # in bf16 the two kernels' rounding can flip a near-tie of the random model)
        "tokens_equal_dense": float((dense_ids == sfi_ids[:, :args.steps]).float().mean()),
        # a whole slow step against a dense one, and a fast one
        "slow_step_over_dense": (parts["none"] + parts["slow_attn"]) / dense_step,
        "fast_step_over_dense": (parts["none"] + parts["fast_attn"]) / dense_step,
        **async_row,
    }
    return row


def _rounded(d: dict) -> dict:
    return {k: (round(v, 3) if isinstance(v, float) else _rounded(v) if isinstance(v, dict) else v)
            for k, v in d.items()}


def _layer_ratios(row: dict) -> None:
    """One sparse layer's slow and fast pass against dense attention (our kernel, SDPA)."""
    p = row["parts_ms"]
    if "sfi_slow_layer" in p:
        for kind in ("slow", "fast"):
            row[f"{kind}_layer_over_sdpa"] = p[f"sfi_{kind}_layer"] / p["sdpa_layer"]
            row[f"{kind}_layer_over_dense"] = p[f"sfi_{kind}_layer"] / p["dense_layer"]


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for b in sorted({r["batch"] for r in result["rows"]}):
        rs = [r for r in result["rows"] if r["batch"] == b]
        ax.plot([r["context"] for r in rs], [r["speedup"] for r in rs], "o-", label=f"batch {b}: measured")
        ax.plot([r["context"] for r in rs], [r["ideal_speedup"] for r in rs], "x--", label=f"batch {b}: ideal")
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s, SFI / dense",
           title=f"{result['shape']} ({result['device']}), slow step every {result['slow_every']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python bench/harness.py",
                                description="decode tokens/s, SFI vs dense (Qwen3-4B shape, dummy "
                                            "weights, SGLang-layout pools; see bench/harness.py)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    p.add_argument("--configs", default="8192x1,8192x64,32768x1,32768x16,131072x1,131072x4",
                   help="comma-separated CONTEXTxBATCH")
    p.add_argument("--steps", type=int, default=96, help="timed decode steps per run")
    p.add_argument("--reps", type=int, default=20, help="repetitions of each timed part")
    p.add_argument("--slow-every", type=int, default=24, help="SFI refresh interval (steps)")
    p.add_argument("--sfi-refresh", choices=("interval", "adaptive"), default="interval",
                   help="adaptive: the harness has no boundary tokens, so slow steps still come every "
                        "--slow-every steps, plus the trigger's (none at the default threshold): what "
                        "the trigger's signal costs a step")
    p.add_argument("--sfi-adaptive-threshold", type=float, default=1e30)
    p.add_argument("--sfi-budget", type=int, default=2048)
    p.add_argument("--sfi-window", type=int, default=256)
    p.add_argument("--sfi-sinks", type=int, default=4)
    p.add_argument("--sfi-dense-layers", default="0,1")
    p.add_argument("--sfi-fast-path", choices=FAST_PATHS, default=SFIConfig.fast_path,
                   help="fast-step kernel (flashinfer: needs --no-cuda-graph, its plan syncs)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--async-maintenance", action="store_true",
                   help="also time SFI with the Selector + pack of slow steps on a side stream")
    p.add_argument("--layers", type=int, default=0, help="override the shape's layer count")
    p.add_argument("--layer-parts", action="store_true",
                   help="also time one sparse layer's fast and slow pass and SDPA (parts_ms)")
    p.add_argument("--parts-only", action="store_true",
                   help="time the parts only (implies --layer-parts; no decode loops)")
    p.add_argument("--out", default="bench/results/throughput", help="writes OUT.json and OUT.png")
    args = p.parse_args(argv)
    try:
        configs = [tuple(int(x) for x in item.split("x")) for item in args.configs.split(",")]
        assert all(len(c) == 2 and c[0] > 1 and c[1] > 0 for c in configs)
    except (ValueError, AssertionError):
        p.error(f"--configs: expected CONTEXTxBATCH[,CONTEXTxBATCH...], got {args.configs!r}")
    if args.sfi_fast_path == "flashinfer" and not args.no_cuda_graph:
        p.error("--sfi-fast-path flashinfer needs --no-cuda-graph (its per-step plan syncs the host)")
    if args.steps < 1 or args.slow_every < 2 or args.reps < 1:
        p.error("--steps and --reps must be >= 1, --slow-every >= 2")
    result = throughput(args)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}.json")
    if args.parts_only:
        return 0
    try:
        plot(result, args.out + ".png")
        print(f"wrote {args.out}.png")
    except ImportError as err:  # no matplotlib on the GPU machine: plot the JSON later
        print(f"no plot ({err}); python -c 'import json, sys; sys.path.insert(0, \"bench\"); import harness as b; "
              f"b.plot(json.load(open(\"{args.out}.json\")), \"{args.out}.png\")'")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
