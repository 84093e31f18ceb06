"""SparseMemory: the per-request SFI sparse memory, in tensors indexed by SGLang's
ReqToTokenPool slot (one concept, one place). Device-agnostic; no SGLang import.

Per slot (request) and sparse layer and KV head, a fast step at context length t attends to
    sinks     [0, min(S, t))
    selected  the sel_count[slot] positions recorded by the last `store` (in [S, win_start))
    window    [min(max(win_start, S), t), t)
(SFI's fast step; the `sfi` backend attends through this class). The three sets are disjoint; when all
candidates were selected their union is the whole history and a fast step equals dense.

Two implementations of the same semantics:
  packed=False (CPU): torch reference. Positions are gathered through req_to_token and
      attended with SDPA, one call per group of rows of equal length (bit-identical to one
      SDPA call per row, the layout of SGLang's torch_native decode).
  packed=True (CUDA, or CPU under TRITON_INTERPRET=1): at `store`, sinks + selected K/V are
      copied by kernels.pack into packed_k/packed_v[layer][slot, h, :S+K] (sinks first,
      then selected), and `attend_fast` is one kernels.fast_decode launch over the packed
      prefix + the window read in place. No host sync on the fast path (CUDA-graph safe).

With cfg.fast_path == "triton-pool" (CUDA), nothing is packed: `store` keeps only the
positions, and kernels.fast_decode reads the sinks and each head's selected positions in
place through req_to_token, as it reads the window (per slot only the lists, not K/V).
With cfg.fast_path == "flashinfer" (CUDA), fast steps run through FlashInfer's paged decode
instead (kernels.flashinfer_fast: page size 1, KV heads folded into the batch, every token
read in place, so nothing is packed): `plan_fast` once per batch size (host), `fast_lists`
once per step and `attend_fast` per layer (device, CUDA-graph capturable).

Slow steps: `attend_slow` = dense attention + raw logits (the Selector's evidence) and key
norms (its prior) in one pass: kernels.dense_decode_with_scores, or kernels.reference (CPU).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sfi_sglang.kernels.reference import extra_positions
from sfi_sglang.method.config import KERNEL_FAST_PATHS, SFIConfigError
from sfi_sglang.method.rows import MemoryRows
from sfi_sglang.method.selector import NORM_DTYPE, key_norms
from sfi_sglang.method.step import FastLists
from sfi_sglang.method.topup import PageSummaries

# A window start past any context: the fast kernel reads no window for such a slot (SGLang's
# padding slot 0, and the device-path rows of requests with SFI off).
NO_WINDOW = 1 << 30


class SparseMemory:
    """Sparse-memory state of up to `max_slots` requests (ReqToTokenPool slots).

    Tensors (all on `device`):
      sel_pos   [L_sparse, N, H_kv, K] int32, selected positions, sorted, -1 padded, by
                memory row (N = max_slots without `rows`, else rows + 1)
      sel_count [max_slots] int32   valid entries of the slot's sel_pos (same for every layer
                                    and head of a selection)
      win_start [max_slots] int64   first window position (= hi of the last selection)
      n_sinks   [max_slots] int32   sinks packed at the last selection (min(S, n)); the
                                    packed path's window then starts at n_sinks when it is
                                    < S, so short contexts grow into the sinks correctly
      fast_ws   [max_slots] int64   the packed path's window start, set by `store`
      counts    [max_slots, 4] int64  fast, slow, dense and deferred decode steps of the
                                    slot's request (dense: steps the whole batch ran
                                    dense, --sfi-dense-below, or the row's FlashInfer lists
                                    outgrew their bound, or it had no memory row yet;
                                    deferred: fast steps whose slow
                                    step --sfi-max-slow-rows put off to the next)
    the kernel paths (every fast path on CUDA) add
      packed_len [max_slots] int32  = n_sinks + sel_count
    and fast_path "triton" also
      packed_k, packed_v  list over sparse layers of [N, H_kv, S+K, D] (`dtype`), by memory row
    Layer ids are model layer ids; `sparse_layer_ids` maps them to rows of sel_pos.

    Memory rows (`rows`, method.rows.MemoryRows): sel_pos and the packed buffers, the bytes
    that scale with a request's budget, are indexed by memory row, not by slot: slot p's
    memory is row rows.row_of[p] (read by the kernels). With `rows` = R there are R + 1 of
    them, row 0 belonging to no request (slots without a row read it and never write it:
    their requests run dense, StepPlan.waits), and the host gives a row to a slot
    (`give_row`) and takes it back (`rows.take`); SGLang's slots then cost a few bytes each.
    """

    def __init__(self, num_layers: int, sparse_layer_ids: Iterable[int], max_slots: int,
                 num_kv_heads: int, head_dim: int, cfg, device, dtype=torch.bfloat16,
                 packed: Optional[bool] = None, group: int = 1, q_dtype: Optional[torch.dtype] = None,
                 rows: Optional[int] = None):
        self.device = torch.device(device)
        self.num_layers = int(num_layers)
        self.sparse_layer_ids = sorted(int(i) for i in sparse_layer_ids)
        self.layer_index = {lid: i for i, lid in enumerate(self.sparse_layer_ids)}
        self.max_slots = int(max_slots)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.cfg = cfg
        self.sinks = int(cfg.sinks)
        self.window = int(cfg.window)
        self.budget = int(cfg.budget)
        self.dtype = dtype
        # packed: the kernel path (CUDA, or CPU under TRITON_INTERPRET=1); the packed K/V
        # buffers exist only for the Triton fast path
        self.packed = (self.device.type == "cuda") if packed is None else bool(packed)
        self.fast_path = cfg.fast_path if self.packed else "reference"
        L, M, H, K = len(self.sparse_layer_ids), self.max_slots, self.num_kv_heads, self.budget
        dev = self.device
        # memory rows: one per slot, or `rows` + 1 (row 0: no request's) given out by the host
        self.rows = MemoryRows(M, rows, dev)
        N = self.rows.allocated
        self.sel_pos = torch.full((L, N, H, K), -1, dtype=torch.int32, device=dev)
        self.sel_count = torch.zeros(M, dtype=torch.int32, device=dev)
        self.win_start = torch.zeros(M, dtype=torch.int64, device=dev)
        self.n_sinks = torch.zeros(M, dtype=torch.int32, device=dev)
        # window start of the packed path, precomputed at store (one gather per fast step)
        self.fast_ws = torch.zeros(M, dtype=torch.int64, device=dev)
        self.counts = torch.zeros(M, 4, dtype=torch.int64, device=dev)
        self.packed_k: list[torch.Tensor] = []
        self.packed_v: list[torch.Tensor] = []
        self.packed_len = None
        if self.fast_path == "triton":
            P = self.sinks + K
            self.packed_k = [torch.zeros(N, H, P, self.head_dim, dtype=dtype, device=dev) for _ in range(L)]
            self.packed_v = [torch.zeros(N, H, P, self.head_dim, dtype=dtype, device=dev) for _ in range(L)]
        if self.packed:
            self.packed_len = torch.zeros(M, dtype=torch.int32, device=dev)
        # the FlashInfer path's lists, rows and planned wrappers (buffers for up to
        # min(M, flashinfer_fast.CHUNK) batch rows: a larger step runs by chunks)
        self._fi = None
        if self.fast_path == "flashinfer":
            from sfi_sglang.kernels.flashinfer_fast import FlashInferFastDecode

            self._fi = FlashInferFastDecode(H, int(group), self.head_dim, self.fast_cap, M, dev,
                                            q_dtype or dtype, holes=cfg.selection_page > 1, kv_dtype=dtype)
        self._k = _kernels() if self.packed else None
        self._ar_k = torch.arange(K, device=dev)
        self._ar_s = torch.arange(self.sinks, device=dev)

    @property
    def fast_cap(self) -> int:
        """The most positions a fast step reads per layer and KV head with the server's
        options: S + K + W, and the window's growth until the refresh budget forces a slow
        step (a request's own larger max_interval or window can exceed it: fast_lists)."""
        return self.cfg.memory_tokens() + self.cfg.max_interval

    @property
    def kernel_fast_path(self) -> bool:
        """Fast steps run kernels.fast_decode (fast_path "triton" or "triton-pool")."""
        return self.fast_path in KERNEL_FAST_PATHS

    # ------------------------------------------------------------------ bookkeeping
    @staticmethod
    def footprint(num_layers: int, num_kv_heads: int, head_dim: int, cfg, dtype, packed: bool,
                  slots: int, rows: Optional[int] = None, group: int = 1, q_dtype=None) -> int:
        """Bytes a SparseMemory of `num_layers` layers, `slots` request slots and `rows`
        memory rows holds (`packed` as in __init__): what SGLang's memory budget must leave
        for it (kv_budget). Measured on the meta device, so it cannot drift from the
        allocation."""
        return SparseMemory(num_layers, range(num_layers), slots, num_kv_heads, head_dim, cfg, "meta",
                            dtype, packed=packed, group=group, q_dtype=q_dtype, rows=rows).bytes()

    def bytes(self) -> int:
        """Device bytes held by this memory (the FlashInfer path's per-row buffers included)."""
        ts = [self.sel_pos, self.rows.row_of, self.sel_count, self.win_start, self.n_sinks, self.fast_ws, self.counts,
              *self.packed_k,
              *self.packed_v]
        if self.packed_len is not None:
            ts.append(self.packed_len)
        if self._fi is not None:
            ts += self._fi.buffers()
        return sum(t.numel() * t.element_size() for t in ts)

    def _slots(self, slots) -> torch.Tensor:
        if not torch.is_tensor(slots):
            slots = torch.as_tensor(list(slots) if not isinstance(slots, int) else [slots])
        return slots.to(device=self.device, dtype=torch.int64)

    # ------------------------------------------------------------------ memory rows
    def row_bytes(self) -> int:
        """Bytes of one memory row: a request's selected positions and packed K/V."""
        ts = [self.sel_pos[:, :1], *(t[:1] for t in self.packed_k), *(t[:1] for t in self.packed_v)]
        return sum(t.numel() * t.element_size() for t in ts)

    def give_row(self, slot: int) -> bool:
        """Host: the slot holds a memory row, given now if it had none (reset: no
        selection; its steps stay counted); False when none is free."""
        if self.rows.has(slot):
            return True
        if self.rows.give(slot) is None:
            return False
        self.reset([slot], counts=False)
        return True

    def reset(self, slots, counts: bool = True) -> None:
        """A new request in these slots: no selection, empty packed memory (and, with
        `counts`, no steps counted)."""
        s = self._slots(slots)
        self.sel_pos[:, self.rows.of(s)] = -1
        self.sel_count[s] = 0
        self.win_start[s] = 0
        self.n_sinks[s] = 0
        self.fast_ws[s] = 0
        if counts:
            self.counts[s] = 0
        if self.packed_len is not None:
            self.packed_len[s] = 0

    def count_steps(self, slots: torch.Tensor, fast: torch.Tensor, slow: torch.Tensor,
                    dense: torch.Tensor | None = None, deferred: torch.Tensor | None = None) -> None:
        """One decode step of the requests in `slots` [B]: fast, slow, dense and deferred
        [B] bool say which rows were which (no host sync; slots are distinct but for padding
        slot 0)."""
        s = self._slots(slots)
        dense = torch.zeros_like(fast) if dense is None else dense
        deferred = torch.zeros_like(fast) if deferred is None else deferred
        self.counts[s] = self.counts[s] + torch.stack([fast, slow, dense, deferred], 1).to(torch.int64)

    def export(self, slot: int):
        """(positions [L_sparse, H_kv, K] int32, count, win_start) of a slot's selection:
        a copy, for sfi_sglang.integration.radix (host sync)."""
        return self.sel_pos[:, self.rows.row(slot)].clone(), int(self.sel_count[slot]), int(self.win_start[slot])

    def import_(self, slot: int, positions: torch.Tensor, count: int, win_start: int,
                kv_caches, req_to_token: torch.Tensor, layer_ids: Iterable[int]) -> None:
        """Start `slot` from an exported selection (of a context whose first win_start
        tokens are this slot's): `store` for each of layer_ids, packing from
        kv_caches(layer_id) -> (k_cache, v_cache)."""
        s = torch.tensor([slot])
        for lid in layer_ids:
            li = self.layer_index[lid]
            k_cache, v_cache = kv_caches(lid)
            self.store(lid, s, positions[li][None], count, win_start, k_cache, v_cache, req_to_token)

    def store(self, layer_id: int, slots, positions: torch.Tensor, sel_count, win_start,
              k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
              seq_lens: Optional[torch.Tensor] = None, only: Optional[torch.Tensor] = None) -> None:
        """Record a selection of one layer for rows `slots` [b].

        positions [b, H_kv, K'] int (K' <= K; sorted ascending, -1 padded; entries at or
        past sel_count are ignored), sel_count [b], win_start [b] (= hi of the selection),
        seq_lens [b] optional: context length at the selection, only needed when it can be
        shorter than the sinks (then only min(S, n) sinks exist yet; default: n >= S).
        only [b] bool, optional: only these rows are stored (the others keep their memory;
        a decode step's slow rows among all). On the Triton fast path, one launch
        (kernels.store_selection) also copies sinks + selected K/V into the packed buffers.
        No host sync.
        """
        li = self.layer_index[layer_id]
        s = self._slots(slots)
        b = s.shape[0]
        if b == 0:
            return
        dev = self.device
        positions = positions.to(dev)
        kp = positions.shape[-1]
        assert kp <= self.budget, f"{kp} selected positions > budget {self.budget}"
        if self.packed:  # one launch: bookkeeping (and pack: kernels.store_selection)
            pack = self.fast_path == "triton"
            self._k.store_selection(
                k_cache, v_cache, req_to_token, s, positions.contiguous(), _per_row(sel_count, b, dev),
                _per_row(win_start, b, dev), None if seq_lens is None else _per_row(seq_lens, b, dev),
                None if only is None else only.to(dev).reshape(-1), self.sinks, self.sel_pos[li],
                self.sel_count, self.win_start, self.n_sinks, self.fast_ws, self.packed_len,
                self.packed_k[li] if pack else None, self.packed_v[li] if pack else None,
                row_of=self.rows.kernel_arg())
            return
        cnt = torch.as_tensor(sel_count, device=dev).to(torch.int64).reshape(-1).expand(b)
        valid = self._ar_k[:kp][None, None, :] < cnt[:, None, None]
        pos = torch.where(valid, positions.to(torch.int32), -1)
        if kp < self.budget:
            pos = torch.nn.functional.pad(pos, (0, self.budget - kp), value=-1)
        ws = torch.as_tensor(win_start, device=dev).to(torch.int64).reshape(-1).expand(b)
        if seq_lens is None:
            ns = torch.full((b,), self.sinks, dtype=torch.int32, device=dev)
        else:
            ns = torch.clamp(torch.as_tensor(seq_lens, device=dev).to(torch.int64).reshape(-1),
                             max=self.sinks).to(torch.int32).expand(b)
        keep = (lambda new, old: new) if only is None else (
            lambda new, old: torch.where(only.reshape((b,) + (1,) * (new.dim() - 1)), new, old))
        r = self.rows.of(s)
        self.sel_pos[li, r] = keep(pos, self.sel_pos[li, r])
        self.sel_count[s] = keep(cnt.to(torch.int32), self.sel_count[s])
        self.win_start[s] = keep(ws, self.win_start[s])
        self.n_sinks[s] = keep(ns, self.n_sinks[s])
        self.fast_ws[s] = keep(self._fast_window_start(s), self.fast_ws[s])

    # ------------------------------------------------------------------ fast step
    def _fast_window_start(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """Window start of the packed path per batch row: max(win_start, S), or n_sinks
        when fewer than S sinks were packed (the window then also covers the later sinks)."""
        ws = self.win_start[req_pool_indices].clamp_min(self.sinks)
        ns = self.n_sinks[req_pool_indices].to(torch.int64)
        return torch.where(ns < self.sinks, ns, ws)

    def step_window_start(self, req_pool_indices: torch.Tensor) -> Optional[torch.Tensor]:
        """The packed fast path's window starts of a decode step's rows (attend_fast's
        win_start), or None on the other paths."""
        if not self.packed or not self.kernel_fast_path:
            return None
        return self.fast_ws[req_pool_indices.to(self.device).long()]

    def plan_fast(self, batch_size: int, sm_scale: float) -> None:
        """Host, once per batch size before its first decode step or graph capture: the
        FlashInfer path's wrapper for that batch size (nothing on the other paths)."""
        if self._fi is not None:
            self._fi.plan(int(batch_size), sm_scale)

    def fast_lists(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor):
        """Device, once per decode step (one launch): the FlashInfer path's per-row list
        lengths, for attend_fast's `fast_plan` (None on the other paths); its `over` [B] bool
        marks rows whose lists outgrow fast_cap (the caller runs them dense this step)."""
        if self._fi is None:
            return None
        from sfi_sglang.kernels import flashinfer_fast as fif

        return FastLists(*fif.lengths(req_pool_indices, seq_lens, self.fast_ws, self.packed_len,
                                      self._fi.cap, self.num_kv_heads, self._fi.rows))

    def attend_fast(self, layer_id: int, q: torch.Tensor, k_cache, v_cache, req_to_token,
                    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                    out: Optional[torch.Tensor] = None, fast_plan=None, max_len: Optional[int] = None,
                    win_start: Optional[torch.Tensor] = None, lse_out: Optional[torch.Tensor] = None,
                    extra: Optional[torch.Tensor] = None, extra_page: Optional[int] = None,
                    extra_base: Optional[int] = None, holes: bool = False, **kernel_kw) -> torch.Tensor:
        """Fast-step attention q [b, H_q, D] -> [b, H_q, D] over sinks + selected + window.
        Triton: one kernels.fast_decode launch (no host sync); FlashInfer: `fast_plan` from
        plan_fast for these rows; else the torch reference over the first max_len
        positions (default max(seq_lens), a host read). win_start: the packed path's
        window starts of these rows, when the caller has them (step_window_start).
        lse_out [b, H_q] float32: also each head's log-sum-exp over the memory (Triton and
        the torch reference; config.py refuses the adaptive trigger on FlashInfer).
        extra [b, H_kv, P] int32: the top-up's pages (method.topup; of extra_page tokens,
        default cfg.page_size, from extra_base, default cfg.topup_lo; -1: none). holes=True:
        the selection may hold -1 within its count (a request's own whole pages; the packed
        kernel then skips them).
        holes or extra on FlashInfer: the torch reference (host rows, eager steps)."""
        li = self.layer_index[layer_id]
        rpi = req_pool_indices.to(self.device).long()
        page = extra_page or self.cfg.page_size
        base = self.cfg.topup_lo if extra_base is None else int(extra_base)
        kernel = self.kernel_fast_path or (extra is None and not holes)
        if kernel and extra is not None:
            kernel_kw.update(extra_pages=extra.to(torch.int32).contiguous(), extra_base=base, extra_page=page)
        if kernel and self.fast_path == "flashinfer":
            fl = fast_plan if fast_plan is not None else self.fast_lists(rpi, seq_lens)
            return self._fi.run(q, k_cache, v_cache, req_to_token, rpi, fl.lengths, fl.start, seq_lens,
                                fl.win_start, self.n_sinks, self.sel_pos[li], self.sel_count, out=out,
                                lse_out=lse_out, row_of=self.rows.kernel_arg())
        if kernel and self.packed:
            ws = self.fast_ws[rpi] if win_start is None else win_start
            if self.fast_path == "triton-pool":
                kernel_kw.update(sel_pos=self.sel_pos[li], n_sinks=self.n_sinks)
                packed = (None, None)
            else:
                packed = (self.packed_k[li], self.packed_v[li])
                if holes or self.cfg.selection_page > 1:  # a head's pages may fill less than the count
                    kernel_kw.update(holes=self.sel_pos[li], hole_base=self.sinks)
            return self._k.fast_decode(q, k_cache, v_cache, req_to_token, rpi, seq_lens, ws,
                                       *packed, self.packed_len, sm_scale, out=out, lse_out=lse_out,
                                       row_of=self.rows.kernel_arg(), **kernel_kw)
        n = self._ref_len(seq_lens, max_len)
        allowed = self._fast_mask(li, rpi, seq_lens, n)
        if extra is not None:
            inside = torch.arange(n, device=self.device) < seq_lens.to(self.device)[:, None, None]
            pos = extra_positions(extra, base, page)
            allowed = allowed | (self._position_mask(pos, n) & inside)
        return self._attend_masked_ref(q, k_cache, v_cache, req_to_token, rpi, allowed, sm_scale, out,
                                       lse_out=lse_out)

    # ------------------------------------------------------------------ torch reference
    # The CPU path: every row of a batch at once (no per-row Python loop, no host read), over
    # the first n positions of each row, n a host int the caller knows (SGLang's
    # seq_lens_cpu); each row attends to the positions its mask allows.
    @staticmethod
    def _ref_len(seq_lens, max_len) -> int:
        if max_len is not None:
            return int(max_len)
        return int(seq_lens.max()) if seq_lens.numel() else 0

    def _fast_mask(self, li, rpi, seq_lens, n: int) -> torch.Tensor:
        """[b, H_kv, n] bool: sinks [0, min(S, t)), the selected positions, the window
        [max(win_start, S), t): a fast step's positions as a mask."""
        j = torch.arange(n, device=self.device)
        t = seq_lens.to(self.device, torch.int64)[:, None, None]
        ws = self.win_start[rpi].clamp_min(self.sinks)[:, None, None]
        keep = (j < self.sinks) | (j >= ws)
        return (keep | self._position_mask(self.sel_pos[li, self.rows.of(rpi)], n)) & (j < t)

    def _position_mask(self, pos: torch.Tensor, n: int) -> torch.Tensor:
        """[b, H, n] bool: the positions pos [b, H, E] (-1 or >= n: none)."""
        pos = pos.long().to(self.device)
        hit = torch.zeros(pos.shape[0], pos.shape[1], n + 1, dtype=torch.bool, device=self.device)
        hit.scatter_(2, torch.where((pos >= 0) & (pos < n), pos, n), True)
        return hit[..., :n]

    def _attend_masked_ref(self, q, k_cache, v_cache, req_to_token, rpi, allowed, sm_scale, out,
                           logits_out=None, lse_out=None):
        """q [b, H_q, D] over positions allowed [b, H_kv, n] (float32 arithmetic); rows with
        nothing allowed give 0. logits_out [b, H_q, >= n]: the raw logits of every position
        < n (-inf where the row's context ends, i.e. past allowed for a dense mask).
        lse_out [b, H_q]: each head's log-sum-exp over its allowed positions."""
        b, hq, d = q.shape
        n = allowed.shape[-1]
        if out is None:
            out = q.new_empty((b, hq, v_cache.shape[-1]))
        if b == 0:
            return out
        if not q.is_cuda:  # the CPU, where host reads cost nothing: compute only what is read
            live = allowed.flatten(1).any(1)
            if not bool(live.all()):  # rows with nothing to read (not in this pass) give 0
                rows = live.nonzero()[:, 0]
                out[~live] = 0
                if logits_out is not None:
                    logits_out[~live] = float("-inf")
                if lse_out is not None:
                    lse_out[~live] = float("-inf")
                if rows.numel():
                    sub_logits, sub_lse = (None if x is None else x.new_empty((rows.numel(),) + x.shape[1:])
                                           for x in (logits_out, lse_out))
                    out[rows] = self._attend_masked_ref(q[rows], k_cache, v_cache, req_to_token, rpi[rows],
                                                        allowed[rows], sm_scale, None, sub_logits, sub_lse)
                    if logits_out is not None:
                        logits_out[rows] = sub_logits
                    if lse_out is not None:
                        lse_out[rows] = sub_lse
                return out
            if logits_out is None:  # a fast step's memory: gather its positions, not all n
                # (always this path, so a row's result does not depend on its batch: its
                # positions in order, then padding read as nothing)
                counts = allowed.sum(-1)  # [b, H_kv]
                return self._attend_listed_ref(q, k_cache, v_cache, req_to_token, rpi, allowed, counts,
                                               int(counts.max()), sm_scale, out, lse_out)
        h = self.num_kv_heads
        tok = req_to_token[rpi, :n].long()                                       # [b, n]
        tok = torch.where(allowed.any(1), tok, 0)  # past a row's context: any valid KV slot
        qg = q.float().view(b, h, hq // h, d)
        logits = torch.matmul(qg, k_cache[tok].float().permute(0, 2, 3, 1)) * sm_scale  # [b, h, g, n]
        masked = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
        if logits_out is not None:
            logits_out[:, :, :n] = masked.reshape(b, hq, n)
            logits_out[:, :, n:] = float("-inf")
        if lse_out is not None:
            lse_out.copy_(torch.logsumexp(masked, -1).reshape(b, hq))
        p = torch.nan_to_num(torch.softmax(masked, -1), nan=0.0)
        v = v_cache[tok].float()  # [b, n, h, d], a new tensor (a gather)
        o = torch.einsum("bhgn,bnhd->bhgd", p, v)
        # A pool slot no row attends (the padding slot 0, one not written yet) may hold any
        # bits, and its weight 0 times NaN is NaN: then V is zeroed where nothing attends and
        # the product taken again. Checked on the (tiny) output, not done on every V: that
        # pass cost ~30% of this function on 2 cores. On CUDA always (no host read).
        if o.is_cuda or not bool(torch.isfinite(o).all()):
            v.masked_fill_(~allowed.transpose(1, 2)[..., None], 0.0)
            o = torch.einsum("bhgn,bnhd->bhgd", p, v)
        out.copy_(o.reshape(b, hq, -1).to(out.dtype))
        return out

    def _attend_listed_ref(self, q, k_cache, v_cache, req_to_token, rpi, allowed, counts, width: int,
                           sm_scale, out, lse_out):
        """_attend_masked_ref over each (row, KV head)'s allowed positions only, `width` at
        most (counts [b, H_kv] of them): gathers width instead of n keys and values."""
        b, hq, d = q.shape
        h = self.num_kv_heads
        # the allowed positions first, in ascending order (a stable sort of the mask)
        idx = torch.sort(allowed.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :width]
        valid = torch.arange(width, device=q.device) < counts[..., None]     # [b, h, width]
        tok = req_to_token[rpi].long().gather(1, idx.reshape(b, -1)).view(b, h, width)
        tok = torch.where(valid, tok, 0)
        heads = torch.arange(h, device=q.device)[None, :, None]
        key = k_cache[tok, heads].float()                                     # [b, h, width, D]
        value = v_cache[tok, heads].float().masked_fill(~valid[..., None], 0.0)
        qg = q.float().view(b, h, hq // h, d)
        logits = torch.matmul(qg, key.transpose(-1, -2)) * sm_scale           # [b, h, g, width]
        masked = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
        if lse_out is not None:
            lse_out.copy_(torch.logsumexp(masked, -1).reshape(b, hq))
        p = torch.nan_to_num(torch.softmax(masked, -1), nan=0.0)
        out.copy_(torch.matmul(p, value).reshape(b, hq, -1).to(out.dtype))
        return out

    def _dense_mask(self, seq_lens, n: int) -> torch.Tensor:
        j = torch.arange(n, device=self.device)
        return (j < seq_lens.to(self.device, torch.int64)[:, None]).unsqueeze(1).expand(-1, self.num_kv_heads, -1)

    def attend_positions(self, q, k_cache, v_cache, req_to_token, rpi, positions, sm_scale, out):
        """q [B, H_q, D] of rows rpi over positions[i] [H_kv, L_i] (torch reference): one
        SDPA call per group of rows of equal length, in the layout of SGLang's torch_native
        decode, so a full position list gives its results."""
        B, Hq, D = q.shape
        H = self.num_kv_heads
        if out is None:
            out = q.new_empty((B, Hq, v_cache.shape[-1]))
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(positions):
            groups.setdefault(p.shape[1], []).append(i)
        heads = torch.arange(H, device=self.device)[None, None, :]
        for L, idx in groups.items():
            rows = torch.tensor(idx, device=self.device)
            if L == 0:  # nothing to attend (a row masked out of this pass)
                out[rows] = 0
                continue
            pos = torch.stack([positions[i] for i in idx])                           # [g, H, L]
            tok = req_to_token[rpi[rows]].long()                                     # [g, N]
            kv_slot = torch.gather(tok, 1, pos.reshape(len(idx), -1)).view(len(idx), H, L)
            kv_slot = kv_slot.transpose(1, 2)                                        # [g, L, H]
            key = k_cache[kv_slot, heads].permute(0, 2, 1, 3)                        # [g, H, L, D]
            value = v_cache[kv_slot, heads].permute(0, 2, 1, 3)
            if key.dtype != q.dtype:
                key, value = key.to(q.dtype), value.to(q.dtype)
            o = scaled_dot_product_attention(q[rows][:, :, None, :], key, value, scale=sm_scale,
                                             enable_gqa=Hq != H)
            out[rows] = o[:, :, 0, :].to(out.dtype)
        return out

    # ------------------------------------------------------------------ slow step
    def attend_slow(self, layer_id: int, q: torch.Tensor, k_cache, v_cache, req_to_token,
                    req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                    out: Optional[torch.Tensor] = None, scores_out: Optional[torch.Tensor] = None,
                    max_len: Optional[int] = None, score_rows: Optional[torch.Tensor] = None,
                    norms_out: Optional[torch.Tensor] = None):
        """Dense attention + raw logits + key norms in one pass: (out [b, H_q, D] q.dtype,
        scores [b, H_q, N] float32, -inf at positions >= seq_len, norms [b, H_kv, >= N]
        NORM_DTYPE, ||k|| of positions < seq_len: the Selector's prior). N =
        scores_out.shape[2], else max_len, else max(seq_lens) (host sync). score_rows [b]
        int32, optional: row i's logits and norms go to row score_rows[i] of scores_out and
        norms_out, none where it is -1 (a step's slow rows among its dense ones: StepPlan's
        score rows). Packed: kernels.dense_decode_with_scores; else the torch reference in
        float32 (kernels.reference), in the torch_native layout (bit-identical to SGLang's
        dense decode on the CPU)."""
        rpi = req_pool_indices.to(self.device).long()
        n = scores_out.shape[2] if scores_out is not None else self._ref_len(seq_lens, max_len)
        if norms_out is None:
            norms_out = q.new_empty((q.shape[0] if scores_out is None else scores_out.shape[0],
                                     self.num_kv_heads, n), dtype=NORM_DTYPE)
        if self.packed:
            out, scores = self._k.dense_decode_with_scores(q, k_cache, v_cache, req_to_token, rpi, seq_lens,
                                                           sm_scale, scores_out=scores_out, out=out, max_len=n,
                                                           score_rows=score_rows, norms_out=norms_out)
            return out, scores, norms_out
        out = torch.empty_like(q) if out is None else out
        mask = self._dense_mask(seq_lens, n)
        rows = torch.arange(q.shape[0], device=q.device) if score_rows is None else score_rows.long()
        kept = rows >= 0
        logits = scores_out if scores_out is not None and score_rows is None else None
        if logits is None:
            logits = torch.empty((q.shape[0], q.shape[1], n), dtype=torch.float32, device=q.device)
        self._attend_masked_ref(q, k_cache, v_cache, req_to_token, rpi, mask, sm_scale, out, logits_out=logits)
        # the norms of the rows that keep their logits only (past seq_len: any slot's, never read)
        tok = torch.where(mask[kept, 0], req_to_token[rpi[kept], :n].long(), 0)
        norms_out[rows[kept], :, :n] = key_norms(k_cache[tok]).permute(0, 2, 1)
        if score_rows is None:
            return out, logits, norms_out
        assert scores_out is not None, "score_rows needs scores_out"
        scores_out[rows[kept]] = logits[kept]
        return out, scores_out, norms_out


def kv_budget(available: int, num_layers: int, num_kv_heads: int, head_dim: int, cfg, dtype,
              packed: bool, slots: int, scores: int = 0, group: int = 1, q_dtype=None,
              rows: Optional[int] = None, page_size: int = 1) -> int:
    """SGLang's KV-pool byte budget once the `sfi` backend's own tensors are set aside: the
    sparse memory (`slots` + 1 request slots like SGLang's req_to_token, `rows` memory rows
    (None: one per slot; "auto": cfg.rows_for the pool these bytes would hold without
    them, no fewer than the backend makes of the pool it gets); `dtype` the KV cache's,
    `q_dtype` the model's where they differ: an fp8 cache), the slow pass's score and
    key-norm buffers (`scores` bytes: step.ScoreBuffers.reserve_bytes) and the top-up's page
    summaries (per pool page of --page-size `page_size`: topup.PageSummaries). Raises
    SFIConfigError when nothing would be left. Called where SGLang sizes its pools
    (hooks._reserve_sfi_memory)."""
    kv_cell = 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
    if rows is not None:  # SFIConfig.rows_for: auto from the pool without them, never past the slots
        rows = cfg.replace(memory_rows=rows).rows_for(max(0, available - scores) // kv_cell, slots + 1)
    mem = SparseMemory.footprint(num_layers, num_kv_heads, head_dim, cfg, dtype, packed, slots + 1, rows,
                                 group, q_dtype)
    side_cell = PageSummaries.token_bytes(cfg, page_size, num_layers, num_kv_heads, head_dim, dtype.itemsize)
    left = int((available - mem - scores) * kv_cell // (kv_cell + side_cell))
    if left <= 0:
        raise SFIConfigError(
            f"SFI's sparse memory for {slots} request slots needs {mem / 2**30:.2f} GiB "
            f"({mem / ((slots if rows is None else rows) + 1) / 2**20:.1f} MiB per memory row with "
            f"--sfi-budget {cfg.budget}) and its slow-step score buffers {scores / 2**30:.2f} GiB "
            f"but the KV budget is {available / 2**30:.2f} GiB: lower --sfi-memory-rows (or "
            "--max-running-requests without it), --sfi-budget or --context-length, or raise "
            "--mem-fraction-static")
    return int(left)


def _per_row(x, b: int, device) -> torch.Tensor:
    """x (an int, a one-element or a [b] tensor) as a contiguous [b] tensor on device."""
    t = torch.as_tensor(x, device=device).reshape(-1)
    return t.expand(b).contiguous() if t.numel() == 1 and b > 1 else t


def _kernels():
    """The Triton kernels package (imported on first use: the CPU path never imports
    Triton, which would fix TRITON_INTERPRET for the whole process)."""
    from sfi_sglang import kernels

    return kernels
