"""The `sfi` attention backend: SGLang's dense backend for prefill and slow steps, a
sparse memory (sinks + selected + window) for fast decode steps.

Per request (indexed by its ReqToTokenPool slot) and per layer and KV head, a fast step
attends to
    sinks     [0, min(S, t))
    selected  K positions chosen in [S, hi) at the last selection
    window    [win_start, t), win_start = hi of the last selection
where t is the current context length. The three sets are disjoint and, when every
candidate of [S, hi) is selected (context <= S + W + K), their union is the whole
history, so the fast step equals dense attention. Selections happen at the end of
prefill (bootstrap, from the last prompt query rows) and at slow steps (dense attention
whose logits feed the Selector), decided per request and step by the TriggerPolicy.

That state lives in a SparseMemory (sfi_sglang.memory): tensors indexed by the request-pool
slot, reset when SGLang allocates the slot (ReqToTokenPool.register_on_alloc_rows); on CUDA
fast steps, slow-step scores and packing run the Triton kernels (sfi_sglang.kernels), on
the CPU the torch reference. A `Request` record per slot keeps only host-side options and
what meta_info reports.

The decode work is planned once per forward in init_forward_metadata (which rows are
fast, which slow, counters, index tensors per layer pattern), and each layer's forward
only computes: no host sync, no host-made tensor, so whole steps can be captured in CUDA
graphs (sfi_sglang.bench does; SGLang's own graph runner is not wired yet).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Optional

import torch

from sfi_sglang.baselines import quest_positions, snapkv_select, streaming_window_start
from sfi_sglang.boundary import TriggerPolicy
from sfi_sglang.kernels import store_key_norms
from sfi_sglang.config import SFIConfig, SFIConfigError, server_config
from sfi_sglang.memory import SparseMemory
from sfi_sglang.selector import select

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

# The backends living in this process (one per model runner), for the output hooks.
ACTIVE: list["SFIAttnBackend"] = []
# rid -> custom_params of requests this scheduler received (filled by sfi_sglang.hooks).
REQUEST_PARAMS: dict[str, dict] = {}
# custom_params key of a request's extra boundary token ids (set by sfi_sglang.router)
EXTRA_IDS_KEY = "sfi_extra_boundary_ids"


def request_options(custom_params) -> tuple[bool, dict]:
    """(enabled, config overrides) from a request's custom_params["sfi"]; raises
    SFIConfigError on a bad value. `enabled` defaults to True."""
    opts = (custom_params or {}).get("sfi") if isinstance(custom_params, dict) else None
    if opts is None:
        return True, {}
    if not isinstance(opts, dict):
        raise SFIConfigError(f'custom_params["sfi"] must be an object, got {type(opts).__name__}')
    opts = dict(opts)
    enabled = opts.pop("enabled", True)
    if not isinstance(enabled, bool):
        raise SFIConfigError(f'custom_params["sfi"]["enabled"] must be true or false, got {enabled!r}')
    # extra boundaries of this request (a spec, resolved to token ids on the tokenizer
    # side by sfi_sglang.router into custom_params[EXTRA_IDS_KEY]); not a config field
    extra = opts.pop("extra_boundaries", None)
    if extra is not None:
        from sfi_sglang.boundary import parse_boundary_spec

        try:
            parse_boundary_spec(extra)
        except ValueError as err:
            raise SFIConfigError(f'custom_params["sfi"]["extra_boundaries"]: {err}') from None
    return enabled, opts


def request_config(server: SFIConfig, custom_params) -> tuple[bool, SFIConfig]:
    """Validated per-request config on top of the server's; the budget may only shrink
    (the server sizes its buffers for its own budget)."""
    enabled, overrides = request_options(custom_params)
    cfg = SFIConfig.from_dict(overrides, base=server) if overrides else server
    if cfg.budget > server.budget:
        raise SFIConfigError(
            f'custom_params["sfi"]["budget"] ({cfg.budget}) exceeds the server\'s '
            f"--sfi-budget ({server.budget})")
    if cfg.sinks != server.sinks:
        raise SFIConfigError(f'custom_params["sfi"]["sinks"] ({cfg.sinks}) cannot differ from the '
                             f"server's --sfi-sinks ({server.sinks})")
    for name in ("boundaries", "fast_path"):  # server-wide: one table, one kernel
        if overrides.get(name, getattr(server, name)) != getattr(server, name):
            raise SFIConfigError(f'custom_params["sfi"]["{name}"] cannot differ from the server\'s '
                                 f"--sfi-{name.replace('_', '-')}")
    return enabled, cfg


@dataclass
class Request:
    """Host-side record of the request in a slot: its options and what the output reports.
    Its sparse memory (selections, step counters) is in SFIAttnBackend.memory, indexed by
    the same slot."""

    cfg: SFIConfig
    enabled: bool
    rid: Optional[str] = None
    bootstrap: bool = False
    has_selection: bool = False  # the memory holds a selection (bootstrap, import, slow step)
    decode_steps: int = 0
    slow_at: list[int] = field(default_factory=list)  # decode steps (1-based) that were slow
    # bootstrap selections computed here vs imported from a shared prefix (sfi_sglang.radix)
    bootstrap_computed: int = 0
    bootstrap_reused: int = 0

    @property
    def refreshes(self) -> bool:
        """Whether this request's method keeps a selection (made at prefill end / slow steps)."""
        return self.cfg.method in ("sfi", "snapkv")

    @property
    def baseline(self) -> bool:
        """Methods whose fast steps choose positions per step on the host (eval baselines)."""
        return self.cfg.method in ("streaming", "quest")

    def stats(self, fast_steps: int, slow_steps: int) -> dict:
        return {"enabled": self.enabled, "fast_steps": fast_steps,
                "slow_steps": slow_steps, "bootstrap": self.bootstrap,
                "bootstrap_computed": self.bootstrap_computed,
                "bootstrap_reused": self.bootstrap_reused,
                "slow_at": list(self.slow_at),
                "budget": self.cfg.budget, "window": self.cfg.window, "sinks": self.cfg.sinks}


class SFIAttnBackend:
    """Wraps the platform's dense backend; same method names as SGLang's backends."""

    def __init__(self, model_runner, dense_backend):
        self.dense = dense_backend
        self.cfg = server_config()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.num_layers = model_runner.model_config.num_hidden_layers
        max_slots = self.req_to_token_pool.req_to_token.shape[0]
        k0 = self.token_to_kv_pool.get_key_buffer(0)
        # The per-request sparse memory, in tensors indexed by request-pool slot; every layer
        # has a row (a request may make any layer sparse or dense).
        self.memory = SparseMemory(self.num_layers, range(self.num_layers), max_slots,
                                   k0.shape[1], k0.shape[2], self.cfg, k0.device, k0.dtype)
        # A slot's memory starts empty when SGLang allocates the slot to a request.
        if getattr(self.req_to_token_pool, "_on_alloc_rows", "absent") is None:
            self.req_to_token_pool.register_on_alloc_rows(self._on_alloc_rows)
        self.requests: dict[int, Request] = {}  # slot -> its request
        self.by_rid: dict[str, tuple[int, Request]] = {}  # for meta_info, read by sfi_sglang.hooks
        self._cfg_cache: dict[str, tuple[bool, SFIConfig]] = {}
        # ||k|| per layer, KV slot and KV head, written with K: a request reusing a cached
        # prefix reuses its norms (the Selector's prior reads them). One tensor per layer,
        # like SGLang's K and V buffers: each starts 16-byte aligned, so every layer
        # launches the same kernel variant (Triton specializes on pointer alignment).
        self.key_norms = [torch.zeros(k0.shape[0], k0.shape[1], dtype=torch.float32, device=k0.device)
                          for _ in range(self.num_layers)]

        self.policy = self._make_policy(model_runner, max_slots)
        self.plan: Optional[DecodePlan] = None
        # Asynchronous maintenance: a slow step's Selector + pack run on this side stream,
        # overlapped with the step's later layers, and the next step waits for them
        # (join_maintenance). CUDA only; off by default until measured inside SGLang
        # (sfi_sglang.bench measures it: --async-maintenance).
        self.side_stream = None
        self._side_pending = False  # side-stream work not yet joined
        self.boundaries = self._boundary_summary(self.cfg.boundaries, 0)  # see install_boundaries
        mc = model_runner.model_config
        tp = getattr(getattr(model_runner, "server_args", None), "tp_size", 1)
        self.warm_up(max(1, mc.num_attention_heads // tp))
        ACTIVE.append(self)
        logger.info("SFI backend: %s, dense backend %s, sparse memory %.1f MB (%s path)", self.cfg,
                    type(dense_backend).__name__, self.memory.bytes() / 2**20,
                    "kernel" if self.memory.packed else "torch reference")

    @staticmethod
    def kv_budget(available: int, num_layers: int, num_kv_heads: int, head_dim: int, cfg: SFIConfig,
                  dtype, packed: bool, slots: int) -> int:
        """SGLang's KV-pool byte budget once this backend's own tensors are set aside: the
        sparse memory (per request slot, `slots` + 1 rows like SGLang's req_to_token) and the
        key norms (per KV-pool token, next to the pool's K and V). Raises SFIConfigError when
        nothing would be left. Called by sfi_sglang.hooks where SGLang sizes its pools."""
        mem = (slots + 1) * SparseMemory.slot_bytes(num_layers, num_kv_heads, head_dim, cfg, dtype, packed)
        kv_cell = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
        norm_cell = num_layers * num_kv_heads * 4  # self.key_norms: L x float32 [tokens, H_kv]
        left = (available - mem) * kv_cell // (kv_cell + norm_cell)
        if left <= 0:
            raise SFIConfigError(
                f"SFI's sparse memory for {slots} request slots needs {mem / 2**30:.2f} GiB "
                f"({mem / (slots + 1) / 2**20:.1f} MiB per slot with --sfi-budget {cfg.budget}) "
                f"but the KV budget is {available / 2**30:.2f} GiB: lower --max-running-requests "
                "or --sfi-budget, or raise --mem-fraction-static")
        return int(left)

    def warm_up(self, num_q_heads: int) -> None:
        """Compile the kernels of a prompt's selection and of every kind of decode row
        (slow: dense attention with scores, the Selector, pack; fast; dense; key norms)
        before serving. Otherwise the first request to need each one waits for its
        compile, seconds each, once per process (bench/NOTES.md, section 7). No kernel
        variant follows the batch or the context (tests/test_kernels.py). What remains
        is the prompt length modulo 16 (Triton's specialization), whether the context
        fits the budget (top-k takes every key), and score buffers capped at
        req_to_token's width: five lengths cover them (tests/test_bench.py).
        A request in slot 0 runs over the real pools before any request exists:
        req_to_token's row 0 is still zeros, so every position reads KV slot 0 (SGLang's
        padding slot). Slot 0 is reset afterwards. Kernel path (CUDA) only."""
        mem, cfg = self.memory, self.cfg
        sparse = [lid for lid in range(self.num_layers) if lid not in cfg.dense_layers]
        if not mem.packed or not sparse or cfg.method != "sfi":
            return
        lid = sparse[0]
        k_cache = self.token_to_kv_pool.get_key_buffer(lid)
        hkv, d, dev, dtype = k_cache.shape[1], k_cache.shape[2], k_cache.device, k_cache.dtype
        layer = SimpleNamespace(layer_id=lid, tp_q_head_num=num_q_heads, tp_k_head_num=hkv,
                                qk_head_dim=d, v_head_dim=d, scaling=d ** -0.5)
        width = self.req_to_token_pool.req_to_token.shape[1]
        long = cfg.sinks + cfg.window + cfg.budget + 32
        lengths = sorted({min(n, width) for n in (SCORE_BUCKET - 1, SCORE_BUCKET - 16, long - 1, long)})
        zeros = lambda *shape, dt=torch.long: torch.zeros(*shape, dtype=dt, device=dev)
        req = self.requests[0] = Request(cfg, True)
        try:
            for n in lengths + [width]:  # the last: score buffers capped at the row width
                if n in lengths:  # a prompt's end: selection from its last rows' logits
                    rows = min(cfg.bootstrap_rows, n)
                    ext = SimpleNamespace(extend_start_loc=zeros(1), extend_seq_lens=torch.tensor([rows]),
                                          req_pool_indices=zeros(1), seq_lens=torch.tensor([n]))
                    self._bootstrap(zeros(rows, num_q_heads * d, dt=dtype), layer, ext)
                for kinds in (["slow", "dense"], ["fast"]):  # decode rows of each kind
                    b = len(kinds)
                    self.plan = DecodePlan(kinds, [req] * b, zeros(b), zeros(b) + n, [n] * b, [0] * b, width)
                    fb = SimpleNamespace(out_cache_loc=zeros(b))
                    k = zeros(b, hkv * d, dt=dtype)
                    self._store_key_norms(k, layer, fb, True)
                    self.forward_decode(zeros(b, num_q_heads * d, dt=dtype), k, k, layer, fb,
                                        save_kv_cache=False)
                    self.join_maintenance()
        finally:
            self.plan = None
            self.requests.pop(0, None)
            mem.reset([0])

    # ------------------------------------------------------------------ SGLang services
    # The three places that need SGLang beyond the pools; sfi_sglang.bench's harness
    # (a GPU machine without SGLang) overrides them.
    def _make_policy(self, model_runner, max_slots: int) -> TriggerPolicy:
        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        args = model_runner.server_args
        tokenizer = get_tokenizer(args.tokenizer_path or args.model_path,
                                  trust_remote_code=args.trust_remote_code)
        return TriggerPolicy.from_tokenizer(tokenizer, self.cfg, max_slots=max_slots,
                                            vocab_size=model_runner.model_config.vocab_size,
                                            device=self.device)

    def _save_kv(self, layer, forward_batch, k, v) -> None:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)

    def _share_prefix(self, slot: int, req: Request, rid, prefix_len: int, seq_len: int) -> bool:
        """Import a shared prefix's memory (sfi_sglang.radix) instead of a bootstrap."""
        from sfi_sglang import radix

        return radix.start_request(self, slot, req, rid, prefix_len, seq_len)

    # ------------------------------------------------------------------ requests
    def _on_alloc_rows(self, slots) -> None:
        self.memory.reset(slots)
        for slot in slots:
            self.requests.pop(slot, None)

    def _slot_config(self, custom_params) -> tuple[bool, SFIConfig]:
        key = json.dumps((custom_params or {}).get("sfi"), sort_keys=True) if isinstance(custom_params, dict) else "null"
        if key not in self._cfg_cache:
            self._cfg_cache[key] = request_config(self.cfg, custom_params)
        return self._cfg_cache[key]

    def _start_requests(self, forward_batch):
        """A request's first extend makes its record (a prompt's next chunk keeps it); its
        bootstrap selection follows in forward_extend unless a shared prefix's memory is
        imported here."""
        slots = forward_batch.req_pool_indices.tolist()
        rids = forward_batch.rids or [None] * len(slots)
        prefix_lens = forward_batch.extend_prefix_lens_cpu or [0] * len(slots)
        seq_lens = forward_batch.seq_lens.tolist()
        for slot, rid, prefix, n in zip(slots, rids, prefix_lens, seq_lens):
            old = self.requests.get(slot)
            if old is not None and old.rid == rid and rid is not None:
                continue
            enabled, cfg = self._slot_config(REQUEST_PARAMS.get(rid))
            req = self.requests[slot] = Request(cfg=cfg, enabled=enabled, rid=rid)
            if old is not None:  # the slot changed hands without an allocation we saw
                self.memory.reset([slot])
            if rid is not None:
                self.by_rid[rid] = (slot, req)
            self.policy.reset(torch.tensor([slot]), cfg)
            if req.enabled and req.refreshes:
                self._share_prefix(slot, req, rid, int(prefix), int(n))

    def export_selection(self, slot: int):
        """(positions [L, H_kv, K], count, hi) of the slot's selection, or None (sfi_sglang.radix)."""
        req = self.requests.get(slot)
        if req is None or not req.enabled or not req.has_selection:
            return None
        return self.memory.export(slot)

    def import_selection(self, slot: int, positions, count: int, hi: int) -> None:
        """Start the slot's request from a shared prefix's selection (sfi_sglang.radix)."""
        req = self.requests[slot]
        pool = self.token_to_kv_pool
        self.memory.import_(slot, positions, count, hi,
                            lambda lid: (pool.get_key_buffer(lid), pool.get_value_buffer(lid)),
                            self.req_to_token_pool.req_to_token,
                            [l for l in range(self.num_layers) if l not in req.cfg.dense_layers])
        req.has_selection = req.bootstrap = True
        req.bootstrap_reused += 1

    # ------------------------------------------------------------------ planning
    def enable_async_maintenance(self, on: bool = True) -> None:
        self.side_stream = torch.cuda.Stream(self.device) if on and torch.cuda.is_available() else None

    def join_maintenance(self) -> None:
        """The current stream waits for the side stream's Selector + pack work (called at
        each forward's start; a captured step must call it before its capture ends)."""
        if self.side_stream is not None and self._side_pending:
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
            self._side_pending = False

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        self.join_maintenance()
        self.dense.init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        self.plan = None
        if mode.is_decode():
            self.plan = self._plan_decode(forward_batch)
        elif mode.is_extend() and not mode.is_mixed():
            self._start_requests(forward_batch)

    def _plan_decode(self, forward_batch) -> "DecodePlan":
        slots = forward_batch.req_pool_indices
        slots_cpu = slots.tolist()
        reqs = [self.requests.get(s) for s in slots_cpu]
        # a request that needs a selection and has none (e.g. its prompt was all cached)
        # makes one now, at a slow step
        have = torch.tensor([r is None or not r.enabled or r.has_selection or not r.refreshes
                             for r in reqs], dtype=torch.bool)
        slow = self.policy.step(forward_batch.input_ids, slots, force=~have.to(slots.device)).cpu()
        self._mark_extra_boundaries(forward_batch, slow)
        kinds = []
        for i, r in enumerate(reqs):
            if r is not None:
                r.decode_steps += 1
            if r is None or not r.enabled:
                kinds.append("dense")
            elif r.refreshes and bool(slow[i]) and (r.cfg.method == "sfi" or not r.has_selection):
                r.slow_at.append(r.decode_steps)
                r.has_selection = True  # after this step (the forward does no host bookkeeping)
                kinds.append("slow")
            else:
                kinds.append("baseline" if r.baseline else "fast")
        plan = DecodePlan(kinds, reqs, slots, forward_batch.seq_lens, forward_batch.seq_lens.tolist(),
                          slots_cpu, self.req_to_token_pool.req_to_token.shape[1])
        dev = slots.device
        rows = lambda kind: slots[torch.tensor([k in kind for k in kinds], device=dev)]
        self.memory.count_steps(rows(("fast", "baseline")), rows(("slow",)))
        return plan

    # ------------------------------------------------------------------ forward
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache=True):
        o = self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self._store_key_norms(k, layer, forward_batch, save_kv_cache)
        mode = forward_batch.forward_mode
        if mode.is_extend() and not mode.is_mixed():
            self._bootstrap(q, layer, forward_batch)
        return o

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache=True):
        plan = self.plan
        self._store_key_norms(k, layer, forward_batch, save_kv_cache)
        lr = plan.layer_rows(layer.layer_id) if plan is not None else None
        if lr is None or lr.all_dense:
            return self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self._save_kv(layer, forward_batch, k, v)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        lid, mem, scale = layer.layer_id, self.memory, layer.scaling
        kc = self.token_to_kv_pool.get_key_buffer(lid)
        vc = self.token_to_kv_pool.get_value_buffer(lid)
        r2t = self.req_to_token_pool.req_to_token
        rpi, seq_lens = plan.slots, plan.seq_lens
        if lr.fast is not None:
            if lr.fast_plan is UNPLANNED:  # first layer of this row pattern in the step
                lr.fast_plan = mem.plan_fast(lr.pattern, rpi[lr.fast], seq_lens[lr.fast],
                                             layer.tp_q_head_num // layer.tp_k_head_num, scale)
            o[lr.fast] = mem.attend_fast(lid, q[lr.fast], kc, vc, r2t, rpi[lr.fast], seq_lens[lr.fast],
                                         scale, fast_plan=lr.fast_plan)
        for g in lr.slow:
            sl = seq_lens[g.rows]
            o[g.rows], scores = mem.attend_slow(lid, q[g.rows], kc, vc, r2t, g.slots, sl, scale,
                                                max_len=g.n_max)
            side = self.side_stream
            if side is None:
                self._select_decode(lid, g, scores, sl)
                continue
            side.wait_stream(torch.cuda.current_stream(self.device))
            self._side_pending = True
            with torch.cuda.stream(side):
                self._select_decode(lid, g, scores, sl)
            for t in (scores, sl):  # made on the main stream, last used on the side stream
                t.record_stream(side)
        if lr.dense is not None:
            o[lr.dense] = mem.attend_dense(q[lr.dense], kc, vc, r2t, rpi[lr.dense], seq_lens[lr.dense],
                                           scale, max_len=lr.dense_n_max)
        for i in lr.baseline:
            pos = baseline_positions(plan.reqs[i].cfg, plan.seq_lens_cpu[i], q[i], kc, r2t[plan.slots_cpu[i]])
            o[i] = mem._attend_positions_ref(q[i:i + 1], kc, vc, r2t, rpi[i:i + 1], [pos], scale, None)[0]
        return o.reshape(o.shape[0], -1)

    def _store_key_norms(self, k, layer, forward_batch, save_kv_cache):
        if save_kv_cache and k is not None:
            store_key_norms(k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim),
                            forward_batch.out_cache_loc, self.key_norms[layer.layer_id])

    # ------------------------------------------------------------------ selection
    def _bootstrap(self, q, layer, forward_batch):
        """End of a prompt (chunk): select from the logits of its last query rows."""
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        lid = layer.layer_id
        k_cache = self.token_to_kv_pool.get_key_buffer(lid)
        req_to_token = self.req_to_token_pool.req_to_token
        starts = forward_batch.extend_start_loc.tolist()
        lens = forward_batch.extend_seq_lens.tolist()
        for i, slot in enumerate(forward_batch.req_pool_indices.tolist()):
            req = self.requests.get(slot)
            if req is None or not req.enabled or not req.refreshes or lid in req.cfg.dense_layers:
                continue
            if req.bootstrap_reused:  # started from a shared prefix's memory
                continue
            cfg = req.cfg
            rows = min(cfg.bootstrap_rows, lens[i])
            n = int(forward_batch.seq_lens[i])
            qi = q[starts[i] + lens[i] - rows: starts[i] + lens[i]]
            lo, hi = cfg.sinks, max(cfg.sinks, n - cfg.window)
            if hi > lo:
                tokens = req_to_token[slot, :n].long()
                keys = k_cache[tokens].float()  # [n, H_kv, D]
                hkv = keys.shape[1]
                qg = qi.float().reshape(rows, hkv, -1, qi.shape[-1])
                logits = torch.einsum("rhgd,nhd->hgrn", qg, keys) * layer.scaling  # [H_kv, G, R, n]
                row_pos = torch.arange(n - rows, n, device=keys.device)
                causal = torch.arange(n, device=keys.device)[None, :] > row_pos[:, None]  # [R, n]
                logits = logits.masked_fill(causal, float("-inf")).reshape(1, hkv, -1, n)
                norms = self.key_norms[lid][tokens].transpose(0, 1)[None]  # [1, H_kv, n]
                bounds = torch.tensor([[lo], [hi]], device=keys.device)
                pos = self._positions(cfg, logits, norms, bounds[0], bounds[1], rows)
            else:
                pos = torch.empty(1, k_cache.shape[1], 0, dtype=torch.int64)
            self.memory.store(lid, [slot], pos, min(cfg.budget, hi - lo), hi, k_cache,
                              self.token_to_kv_pool.get_value_buffer(lid), req_to_token,
                              seq_lens=torch.tensor([n]))
            req.bootstrap = req.has_selection = True

    def _select_decode(self, lid, g: "SlowGroup", scores, seq_lens):
        """Slow-step rows of one config: the Selector on their dense logits scores
        [b, H_q, N], stored as the layer's new selection. No host sync, no host-made
        tensor: CUDA-graph capturable (sfi_sglang.bench captures slow steps)."""
        b, hq, n = scores.shape
        hkv = self.memory.num_kv_heads
        logits = scores.view(b, hkv, hq // hkv, n)
        tokens = self.req_to_token_pool.req_to_token[g.slots, :n]  # position -> KV slot
        cfg = g.cfg
        hi = (seq_lens - cfg.window).clamp_min(cfg.sinks)
        lo = torch.full_like(hi, cfg.sinks)
        # the Selector gathers the key norms of the candidates itself (in-kernel on CUDA)
        pos = self._positions(cfg, logits, self.key_norms[lid], lo, hi, 1, norm_tokens=tokens)
        pool = self.token_to_kv_pool
        self.memory.store(lid, g.slots, pos, (hi - lo).clamp_max(cfg.budget), hi, pool.get_key_buffer(lid),
                          pool.get_value_buffer(lid), self.req_to_token_pool.req_to_token,
                          seq_lens=seq_lens)

    def _positions(self, cfg, logits, norms, lo, hi, n_rows, norm_tokens=None) -> torch.Tensor:
        """Selected positions [b, H_kv, <= K] (sorted, -1 padded) from logits [b, H_kv, R', N];
        lo, hi [b] int64 tensors on the logits' device; norms as in selector.select."""
        if cfg.method == "snapkv":
            out = torch.full((logits.shape[0], logits.shape[1], cfg.budget), -1, dtype=torch.int64)
            for i, (l, h) in enumerate(zip(lo.tolist(), hi.tolist())):
                sel = snapkv_select(logits[i].cpu(), l, h, cfg.budget)
                out[i, :, :sel.shape[1]] = sel
            return out.to(logits.device)
        return select(logits, norms, lo, hi, cfg.budget, n_rows, cfg, norm_tokens=norm_tokens)

    # ------------------------------------------------------------------ boundaries
    def install_boundaries(self, is_boundary: torch.Tensor, is_content: torch.Tensor,
                           spec: str, version: int) -> None:
        """A new server-wide boundary table (from the tokenizer side, sfi_sglang.router),
        copied in place into the policy's device tables, so their addresses stay valid;
        the next decode step uses it. Ids past the given tables are neither."""
        pol = self.policy
        for src, dst in ((is_boundary, pol.is_boundary), (is_content, pol.is_content)):
            n = min(dst.numel(), src.numel())
            full = torch.zeros(dst.numel(), dtype=torch.bool)
            full[:n] = src[:n].cpu()
            dst.copy_(full.to(dst.device))
        self.boundaries = self._boundary_summary(spec, version)

    def _boundary_summary(self, spec: str, version: int) -> dict:
        import time

        return {"spec": spec, "version": version, "vocab_size": self.policy.vocab,
                "num_boundary": int(self.policy.is_boundary.sum()),
                "num_content": int(self.policy.is_content.sum()), "installed_at": time.time()}

    def _mark_extra_boundaries(self, forward_batch, slow: torch.Tensor) -> None:
        """Per-request boundaries on top of the server's table: the request's extra
        boundary ids (custom_params[EXTRA_IDS_KEY]) and grammar-aware boundaries (a
        grammar of sfi_sglang.grammar flags the token that ended a JSON field). Such an
        input token makes the refresh pending, as a table boundary does in
        TriggerPolicy.step (outside the cooldown, not at a slow step)."""
        rids = forward_batch.rids or []
        info = forward_batch.sampling_info
        grammars = (getattr(info, "grammars", None) if info is not None else None) or []
        extra = [(REQUEST_PARAMS.get(rid) or {}).get(EXTRA_IDS_KEY) for rid in rids]
        if not any(extra) and not any(g is not None for g in grammars):
            return  # the common case: no host work
        ids = forward_batch.input_ids.tolist()
        hit = []
        for i, slot in enumerate(forward_batch.req_pool_indices.tolist()):
            g = grammars[i] if i < len(grammars) else None
            flagged = bool(getattr(g, "sfi_boundary", False))
            if flagged:
                g.sfi_boundary = False
            if (flagged or (i < len(extra) and extra[i] and ids[i] in extra[i])) and not bool(slow[i]):
                hit.append(slot)
        if hit:
            pol = self.policy
            s = torch.tensor(hit, dtype=torch.int64, device=pol.pending.device)
            pol.pending[s] |= pol.since[s] > pol.cooldown[s]

    # ------------------------------------------------------------------ SGLang hooks
    def __getattr__(self, name):
        # Everything SFI does not change (CUDA-graph hooks, support_triton, ...) is the
        # dense backend's.
        return getattr(self.dense, name)

    def request_stats(self, rid: str, finished: bool) -> Optional[dict]:
        if finished:
            REQUEST_PARAMS.pop(rid, None)
        entry = self.by_rid.pop(rid, None) if finished else self.by_rid.get(rid)
        if entry is None:
            return None
        slot, req = entry
        fast, slow = self.memory.counts[slot].tolist()
        return req.stats(fast, slow)


# Slow steps' score buffers are sized in steps of this many positions (past a row's context
# the scores are -inf), so a captured slow step serves the next SCORE_BUCKET contexts.
SCORE_BUCKET = 512


UNPLANNED = object()


@dataclass
class SlowGroup:
    """Slow-step rows of one config (made once per forward, so layers do no host work)."""

    cfg: SFIConfig
    rows: torch.Tensor  # batch rows
    slots: torch.Tensor  # their request-pool slots
    n_max: int  # the score buffer's length: max context, rounded up to SCORE_BUCKET


@dataclass
class LayerRows:
    """Batch rows of one layer by what they compute (index tensors on the batch's device)."""

    fast: Optional[torch.Tensor]
    slow: list[SlowGroup]  # one group per config
    dense: Optional[torch.Tensor]
    dense_n_max: int
    baseline: list[int]
    all_dense: bool
    pattern: int = 0  # which of the step's row patterns this is
    fast_plan: object = UNPLANNED  # SparseMemory.plan_fast's result, made at the first layer


@dataclass
class DecodePlan:
    kinds: list[str]  # per batch row: "fast" | "slow" | "dense" | "baseline"
    reqs: list[Optional[Request]]
    slots: torch.Tensor  # req_pool_indices
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    slots_cpu: list[int]
    max_context: int  # req_to_token's width: no score buffer is longer
    _layers: dict = field(default_factory=dict)

    def layer_rows(self, layer_id: int) -> LayerRows:
        """Rows of this layer: a row whose config keeps the layer dense is dense there.
        Computed once per pattern of dense rows per forward."""
        kinds = tuple("dense" if k != "dense" and layer_id in self.reqs[i].cfg.dense_layers else k
                      for i, k in enumerate(self.kinds))
        if kinds not in self._layers:
            dev = self.slots.device
            idx = lambda kind: [i for i, k in enumerate(kinds) if k == kind]
            as_rows = lambda rows: torch.tensor(rows, dtype=torch.int64, device=dev) if rows else None
            groups: dict = {}
            for i in idx("slow"):
                groups.setdefault(self.reqs[i].cfg, []).append(i)
            slow = []
            for cfg, rows in groups.items():
                n_max = max(self.seq_lens_cpu[i] for i in rows)
                r = as_rows(rows)
                slow.append(SlowGroup(cfg=cfg, rows=r, slots=self.slots[r],
                                      n_max=min(-(-n_max // SCORE_BUCKET) * SCORE_BUCKET, self.max_context)))
            dense = idx("dense")
            self._layers[kinds] = LayerRows(
                fast=as_rows(idx("fast")), slow=slow, dense=as_rows(dense),
                dense_n_max=max([self.seq_lens_cpu[i] for i in dense], default=0),
                baseline=idx("baseline"), all_dense=all(k == "dense" for k in kinds),
                pattern=len(self._layers))
        return self._layers[kinds]


def baseline_positions(cfg: SFIConfig, n: int, q, k_cache, tokens) -> torch.Tensor:
    """Positions [H_kv, L] of a StreamingLLM or Quest fast step at context length n
    (sinks, then the method's middle part, then the window; ascending and disjoint).
    q [H_q, D] is this step's query (Quest uses it)."""
    hkv = k_cache.shape[1]
    dev = tokens.device
    sinks = torch.arange(min(cfg.sinks, n), device=dev).expand(hkv, -1)
    if cfg.method == "streaming":
        start = streaming_window_start(n, cfg.sinks, cfg.window, cfg.budget)
        return torch.cat([sinks, torch.arange(start, n, device=dev).expand(hkv, -1)], dim=1)
    hi = max(cfg.sinks, n - cfg.window)
    keys = k_cache[tokens[:hi].long()]
    sel = quest_positions(q.reshape(hkv, -1, q.shape[-1]), keys, cfg.sinks, hi, cfg.budget,
                          cfg.page_size).to(dev)
    return torch.cat([sinks, sel, torch.arange(min(hi, n), n, device=dev).expand(hkv, -1)], dim=1)
