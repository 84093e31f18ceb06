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

The decode work is planned once per forward in init_forward_metadata (which rows are
fast, which slow, counters), and each layer's forward only computes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sfi_sglang.baselines import quest_positions, snapkv_select, streaming_window_start
from sfi_sglang import radix
from sfi_sglang.boundary import TriggerPolicy
from sfi_sglang.kernels import store_key_norms
from sfi_sglang.config import SFIConfig, SFIConfigError, server_config
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
    if overrides.get("boundaries", server.boundaries) != server.boundaries:
        raise SFIConfigError('custom_params["sfi"]["boundaries"] cannot differ from the server\'s '
                             "--sfi-boundaries")
    return enabled, cfg


@dataclass
class SlotState:
    """SFI state of one request slot (CPU reference path)."""

    cfg: SFIConfig
    enabled: bool
    fast_steps: int = 0
    slow_steps: int = 0
    bootstrap: bool = False
    decode_steps: int = 0
    slow_at: list[int] = field(default_factory=list)  # decode steps (1-based) that were slow
    # per layer: selected positions [H_kv, n_sel] (sorted), and where the window starts
    selected: dict[int, torch.Tensor] = field(default_factory=dict)
    win_start: int = 0
    rid: Optional[str] = None
    # bootstrap selections computed here vs imported from a shared prefix (sfi_sglang.radix)
    bootstrap_computed: int = 0
    bootstrap_reused: int = 0

    @property
    def refreshes(self) -> bool:
        """Whether this request's method keeps a selection (made at prefill end / slow steps)."""
        return self.cfg.method in ("sfi", "snapkv")

    def stats(self) -> dict:
        return {"enabled": self.enabled, "fast_steps": self.fast_steps,
                "slow_steps": self.slow_steps, "bootstrap": self.bootstrap,
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
        self.slots: dict[int, SlotState] = {}
        self.by_rid: dict[str, SlotState] = {}  # for meta_info, read by sfi_sglang.hooks
        self._cfg_cache: dict[str, tuple[bool, SFIConfig]] = {}
        # ||k|| per layer, KV slot and KV head, written with K: a request reusing a cached
        # prefix reuses its norms (the Selector's prior reads them)
        k0 = self.token_to_kv_pool.get_key_buffer(0)
        self.key_norms = torch.zeros(self.num_layers, k0.shape[0], k0.shape[1],
                                     dtype=torch.float32, device=k0.device)

        from sglang.srt.utils.hf_transformers_utils import get_tokenizer

        args = model_runner.server_args
        tokenizer = get_tokenizer(args.tokenizer_path or args.model_path,
                                  trust_remote_code=args.trust_remote_code)
        self.policy = TriggerPolicy.from_tokenizer(
            tokenizer, self.cfg, max_slots=self.req_to_token_pool.req_to_token.shape[0],
            vocab_size=model_runner.model_config.vocab_size, device=self.device)
        self.plan: Optional[DecodePlan] = None
        self.boundaries = self._boundary_summary(self.cfg.boundaries, 0)  # see install_boundaries
        ACTIVE.append(self)
        logger.info("SFI backend: %s, dense backend %s", self.cfg, type(dense_backend).__name__)

    # ------------------------------------------------------------------ planning
    def _slot_config(self, custom_params) -> tuple[bool, SFIConfig]:
        key = json.dumps((custom_params or {}).get("sfi"), sort_keys=True) if isinstance(custom_params, dict) else "null"
        if key not in self._cfg_cache:
            self._cfg_cache[key] = request_config(self.cfg, custom_params)
        return self._cfg_cache[key]

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        self.dense.init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        self.plan = None
        if mode.is_decode():
            self.plan = self._plan_decode(forward_batch)
        elif mode.is_extend() and not mode.is_mixed():
            self._start_requests(forward_batch)

    def _start_requests(self, forward_batch):
        """Each extend (a new request, or the next chunk of its prompt) restarts the
        request's SFI state; the bootstrap selection follows in forward_extend."""
        slots = forward_batch.req_pool_indices.tolist()
        rids = forward_batch.rids or [None] * len(slots)
        prefix_lens = forward_batch.extend_prefix_lens_cpu or [0] * len(slots)
        seq_lens = forward_batch.seq_lens.tolist()
        for slot, rid, prefix, n in zip(slots, rids, prefix_lens, seq_lens):
            enabled, cfg = self._slot_config(REQUEST_PARAMS.get(rid))
            st = self.slots[slot] = SlotState(cfg=cfg, enabled=enabled, rid=rid)
            if rid is not None:
                self.by_rid[rid] = st
            self.policy.reset(torch.tensor([slot]), cfg)
            # a shared prefix's memory, when there is one, replaces the bootstrap selection
            radix.start_request(st, rid, int(prefix), int(n))

    def _plan_decode(self, forward_batch) -> "DecodePlan":
        slots = forward_batch.req_pool_indices
        states = [self.slots.get(s) for s in slots.tolist()]
        # a request that needs a selection and has none (e.g. its prompt was all cached)
        # makes one now, at a slow step
        have = torch.tensor([st is None or not st.enabled or bool(st.selected) or not st.refreshes
                             for st in states], dtype=torch.bool)
        slow = self.policy.step(forward_batch.input_ids, slots, force=~have.to(slots.device)).cpu()
        self._mark_extra_boundaries(forward_batch, slow)
        rows = []
        for i, st in enumerate(states):
            if st is not None:
                st.decode_steps += 1
            if st is None or not st.enabled:
                rows.append("dense")
            elif bool(slow[i]) and (st.cfg.method == "sfi" or not st.selected) and st.refreshes:
                st.slow_steps += 1
                st.slow_at.append(st.decode_steps)
                rows.append("slow")
            else:
                st.fast_steps += 1
                rows.append("fast")
        return DecodePlan(rows=rows, states=states, seq_lens=forward_batch.seq_lens.tolist(),
                          slots=slots.tolist())

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
        if plan is None or all(r == "dense" for r in plan.rows):
            return self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        for i, kind in enumerate(plan.rows):
            n, slot, st = plan.seq_lens[i], plan.slots[i], plan.states[i]
            if kind != "dense" and layer.layer_id in st.cfg.dense_layers:
                kind = "dense"
            if kind == "fast":
                pos = fast_positions(st, layer.layer_id, n, q[i], k_cache, req_to_token[slot])
                o[i] = attend(q[i], k_cache, v_cache, req_to_token[slot], pos, layer.scaling)
            else:
                pos = torch.arange(n).expand(layer.tp_k_head_num, n)
                o[i] = attend(q[i], k_cache, v_cache, req_to_token[slot], pos, layer.scaling)
                if kind == "slow":
                    self._select(plan.states[i], layer, q[i:i + 1], k_cache, req_to_token[slot], n)
        return o.reshape(o.shape[0], -1)

    def _store_key_norms(self, k, layer, forward_batch, save_kv_cache):
        if save_kv_cache and k is not None:
            store_key_norms(k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim),
                            forward_batch.out_cache_loc, self.key_norms[layer.layer_id])

    # ------------------------------------------------------------------ selection
    def _bootstrap(self, q, layer, forward_batch):
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        starts = forward_batch.extend_start_loc.tolist()
        lens = forward_batch.extend_seq_lens.tolist()
        for i, slot in enumerate(forward_batch.req_pool_indices.tolist()):
            st = self.slots.get(slot)
            if st is None or not st.enabled or not st.refreshes or layer.layer_id in st.cfg.dense_layers:
                continue
            if st.bootstrap_reused:  # started from a shared prefix's memory
                continue
            rows = min(st.cfg.bootstrap_rows, lens[i])
            n = int(forward_batch.seq_lens[i])
            qi = q[starts[i] + lens[i] - rows: starts[i] + lens[i]]
            self._select(st, layer, qi, k_cache, req_to_token[slot], n)
            st.bootstrap = True

    def _select(self, st: SlotState, layer, q_rows, k_cache, tokens, n: int):
        """Run the Selector on the logits of q_rows [R, H_q, D], the last R positions of a
        context of length n, and store the selection for this layer."""
        cfg = st.cfg
        lo, hi = cfg.sinks, max(cfg.sinks, n - cfg.window)
        st.win_start = hi
        if hi <= lo:
            st.selected[layer.layer_id] = torch.empty(layer.tp_k_head_num, 0, dtype=torch.int64)
            return
        keys = k_cache[tokens[:n].long()].float()  # [n, H_kv, D]
        hkv, r = keys.shape[1], q_rows.shape[0]
        g = q_rows.shape[1] // hkv
        qg = q_rows.float().reshape(r, hkv, g, -1)
        logits = torch.einsum("rhgd,nhd->hgrn", qg, keys) * layer.scaling  # [H_kv, G, R, n]
        row_pos = torch.arange(n - r, n)
        causal = torch.arange(n)[None, :] > row_pos[:, None]  # [R, n]
        logits = logits.masked_fill(causal, float("-inf")).reshape(1, hkv, g * r, n)
        if cfg.method == "snapkv":
            st.selected[layer.layer_id] = snapkv_select(logits[0], lo, hi, cfg.budget)
            return
        norms = self.key_norms[layer.layer_id][tokens[:n].long()].transpose(0, 1)[None]  # [1, H_kv, n]
        pos = select(logits, norms, torch.tensor([lo]), torch.tensor([hi]), cfg.budget, r, cfg)[0]
        count = min(cfg.budget, hi - lo)
        st.selected[layer.layer_id] = pos[:, :count]

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
        st = self.by_rid.pop(rid, None) if finished else self.by_rid.get(rid)
        return st.stats() if st is not None else None


@dataclass
class DecodePlan:
    rows: list[str]  # per batch row: "fast" | "slow" | "dense"
    states: list[Optional[SlotState]]
    seq_lens: list[int]
    slots: list[int]


def fast_positions(st: SlotState, layer_id: int, n: int, q, k_cache, tokens) -> torch.Tensor:
    """Positions [H_kv, L] of a fast step at context length n: sinks, selected, window
    (ascending and disjoint). q [H_q, D] is this step's query (Quest uses it)."""
    cfg = st.cfg
    hkv = k_cache.shape[1]
    sinks = torch.arange(min(cfg.sinks, n)).expand(hkv, -1)
    if cfg.method == "streaming":
        start = streaming_window_start(n, cfg.sinks, cfg.window, cfg.budget)
        return torch.cat([sinks, torch.arange(start, n).expand(hkv, -1)], dim=1)
    if cfg.method == "quest":
        hi = max(cfg.sinks, n - cfg.window)
        keys = k_cache[tokens[:hi].long()]
        sel = quest_positions(q.reshape(hkv, -1, q.shape[-1]), keys, cfg.sinks, hi, cfg.budget,
                              cfg.page_size)
        return torch.cat([sinks, sel, torch.arange(min(hi, n), n).expand(hkv, -1)], dim=1)
    sel = st.selected[layer_id]
    window = torch.arange(min(max(st.win_start, cfg.sinks), n), n).expand(hkv, -1)
    return torch.cat([sinks, sel, window], dim=1)


def attend(q, k_cache, v_cache, tokens, pos, scaling):
    """One decode row: q [H_q, D] over positions pos [H_kv, L] of one request (KV slots
    via its req_to_token row). Same SDPA call and layout as SGLang's torch_native decode,
    so a full position list gives bit-identical results."""
    hkv = pos.shape[0]
    slots = tokens[pos.T].long()  # [L, H_kv]
    heads = torch.arange(hkv)[None, :]
    key = k_cache[slots, heads].movedim(0, 1)  # [H_kv, L, D]
    value = v_cache[slots, heads].movedim(0, 1)
    if key.dtype != q.dtype:
        key, value = key.to(q.dtype), value.to(q.dtype)
    out = scaled_dot_product_attention(q[None, :, None, :], key[None], value[None],
                                       scale=scaling, enable_gqa=q.shape[0] != hkv)
    return out[0, :, 0, :]
