"""The `sfi` attention backend: SGLang's dense backend for prefill, a sparse memory (sinks +
selected + window) for fast decode steps, dense attention + the Selector for slow ones.

Per request (indexed by its ReqToTokenPool slot) and per layer and KV head, a fast step
attends to
    sinks     [0, min(S, t))
    selected  K positions chosen in [S, hi) at the last selection
    window    [win_start, t), win_start = hi of the last selection
where t is the current context length. The three sets are disjoint and, when every
candidate of [S, hi) is selected (context <= S + W + K), their union is the whole
history, so the fast step equals dense attention. Selections happen at the end of
prefill (bootstrap, from the last prompt query rows) and at slow steps (dense attention
whose logits feed the Selector).

Where the state lives:
  - SparseMemory (sfi_sglang.memory): selections, window starts, packed K/V, fast/slow
    counts, in tensors indexed by the request-pool slot;
  - StepPlan (sfi_sglang.step): the per-slot switches and the trigger policy; it decides
    on the device, at each decode forward, which rows are fast, slow or dense;
  - Request (sfi_sglang.requests): a slot's host-side options and meta_info fields.

A decode step is device work only, with static shapes, so SGLang's decode CUDA graphs
capture it and its overlap scheduler runs it: StepPlan.begin runs in
init_forward_metadata_in_graph, and each sparse layer runs the fast kernel over every row,
then, inside a conditional graph node taken only when some row is slow or dense at that
layer, dense attention with scores for those rows, the Selector and the memory update of
the slow ones (masked per row). Requests whose options the device step cannot serve (the
eval's baselines, a different budget, window or Selector) run on a host path, eagerly only
(sfi_sglang.requests.on_device_path).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from types import SimpleNamespace
from typing import TYPE_CHECKING, Optional

import torch

from sfi_sglang.baselines import quest_positions, snapkv_select, streaming_window_start
from sfi_sglang.boundary import TriggerPolicy
from sfi_sglang.config import SFIConfig, SFIConfigError, server_config
from sfi_sglang.kernels import store_key_norms
from sfi_sglang.memory import SparseMemory
from sfi_sglang.requests import EXTRA_IDS_KEY, Request, on_device_path, request_config
from sfi_sglang.selector import select
from sfi_sglang.step import StepPlan, run_if

try:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
except ImportError:  # sfi_sglang.bench's harness on a GPU machine without SGLang
    AttentionBackend = object

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

# The backends living in this process (one per model runner), for the output hooks.
ACTIVE: list["SFIAttnBackend"] = []
# rid -> custom_params of requests this scheduler received (filled by sfi_sglang.hooks).
REQUEST_PARAMS: dict[str, dict] = {}
# A window start past any context: the fast kernel reads no window for such a slot.
NO_WINDOW = 1 << 30
# A slow step keeps every sparse layer's scores until the step's end and runs the Selector
# once for all layers (rows = layers x requests: ~15 launches instead of ~15 per layer)
# while the scores of a step fit in this many bytes; larger steps select layer by layer.
SELECT_BATCH_BYTES = 512 << 20
# Set to "1" (tests): a device-path decode layer that reads a tensor to the host
# (Tensor.item/.tolist/.cpu) raises instead, so a sync that would stall CUDA graphs and the
# overlap scheduler fails loudly on the CPU engine too.
SYNC_GUARD_ENV = "SFI_SGLANG_SYNC_GUARD"


@contextlib.contextmanager
def no_host_reads(on: bool = True):
    """Inside: Tensor.item, .tolist and .cpu raise RuntimeError (when `on`)."""
    if not on:
        yield
        return
    names = ("item", "tolist", "cpu")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def f(self, *args, **kwargs):
            raise RuntimeError(f"SFI decode step read a tensor to the host (Tensor.{name})")
        return f

    for n in names:
        setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


class SFIAttnBackend(AttentionBackend):
    """SGLang attention backend `sfi`: wraps the platform's dense backend (prefill and the
    layers every request keeps dense) and implements SGLang's decode CUDA-graph protocol
    (init_cuda_graph_state, init_forward_metadata_out_graph / _in_graph, the seq-len fill
    value) for its own decode step."""

    def __init__(self, model_runner, dense_backend):
        self.dense = dense_backend
        # SGLang's runners read the base class's capability flags off the backend: the
        # dense backend's values hold (SFI changes decode attention only)
        if AttentionBackend is not object:
            for name, value in vars(AttentionBackend).items():
                if not name.startswith("_") and isinstance(value, (bool, int, type(None))):
                    setattr(self, name, getattr(dense_backend, name, value))
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
        self.memory.fast_ws[0] = NO_WINDOW  # slot 0: SGLang's padding rows
        # A slot's memory starts empty when SGLang allocates the slot to a request; the reset
        # runs at the request's first forward, on the forward stream (with the overlap
        # scheduler the allocation happens while an earlier step still runs).
        self._resets: list[int] = []
        if getattr(self.req_to_token_pool, "_on_alloc_rows", "absent") is None:
            self.req_to_token_pool.register_on_alloc_rows(self._on_alloc_rows)
        # the `sfi` radix cache finds this backend on the pool both use (radix.sfi_backend)
        self.req_to_token_pool.sfi_backend = self
        self.requests: dict[int, Request] = {}  # slot -> its request
        self.by_rid: dict[str, tuple[int, Request]] = {}  # for meta_info, read by sfi_sglang.hooks
        self._cfg_cache: dict[str, tuple[bool, SFIConfig]] = {}
        # Requests SGLang retracted (decode out of KV memory: their KV is freed and recomputed
        # by a later prefill): (rid, slot, record) until the next forward saves their history,
        # then rid -> (record, history) until they resume or finish (see suspend)
        self._retracted: list[tuple[str, int, Request]] = []
        self.suspended: dict[str, tuple[Request, dict]] = {}
        # ||k|| per layer, KV slot and KV head, written with K: a request reusing a cached
        # prefix reuses its norms (the Selector's prior reads them). One tensor per layer,
        # like SGLang's K and V buffers: each starts 16-byte aligned, so every layer
        # launches the same kernel variant (Triton specializes on pointer alignment).
        # Views of one tensor whose layers start 4 rows apart (16-byte aligned rows for any
        # H_kv): the step's batched Selector gathers every layer's norms through one pointer.
        rows4 = -(-k0.shape[0] // 4) * 4
        self._norms_all = torch.zeros(self.num_layers, rows4, k0.shape[1], dtype=torch.float32,
                                      device=k0.device)
        self.key_norms = [n[:k0.shape[0]] for n in self._norms_all.unbind(0)]
        self.policy = self._make_policy(model_runner, max_slots)
        self.step = StepPlan(self.policy, max_slots, self.num_layers, self.device)
        mc = model_runner.model_config
        tp = getattr(getattr(model_runner, "server_args", None), "tp_size", 1) or 1
        self.num_q_heads = max(1, mc.num_attention_heads // tp)
        # Slow steps' logits [rows, H_q, N], N = req_to_token's width (the longest context):
        # made once for the CUDA graphs' batch (init_cuda_graph_state), else per batch size.
        self._scores: Optional[torch.Tensor] = None  # eager steps
        self._graph_scores: Optional[torch.Tensor] = None  # captured steps (init_cuda_graph_state)
        # the batched Selector's inputs: every sparse layer's scores of a step (a flat buffer,
        # made once, never replaced: graphs write into it), and each sparse layer's offset
        # into the flattened key norms
        self._sparse_ids = [lid for lid in range(self.num_layers) if lid not in self.cfg.dense_layers]
        self._sparse_index = {lid: i for i, lid in enumerate(self._sparse_ids)}
        # refresh "adaptive": the fast step's log-sum-exps of a few middle sparse layers
        # [layers, rows, H_q], written by the fast kernel and read once per step by the
        # trigger (TriggerPolicy.observe); a buffer made once (graphs write into it)
        self._lse_layers = self._monitored_layers() if self.cfg.refresh == "adaptive" else []
        self._lse_index = {lid: i for i, lid in enumerate(self._lse_layers)}
        self._lse: Optional[torch.Tensor] = None
        self._lse_t = torch.tensor(self._lse_layers, dtype=torch.int64, device=k0.device)
        self.cfg.check_tp(tp)
        if self._lse_layers:
            self.policy.monitor(len(self._lse_layers), self.num_q_heads)
            self._lse = torch.full((len(self._lse_layers), max_slots, self.num_q_heads), float("-inf"),
                                   dtype=torch.float32, device=k0.device)
        self._norm_offsets = torch.tensor([lid * rows4 for lid in self._sparse_ids], dtype=torch.int32,
                                          device=k0.device)
        self._sparse_t = torch.tensor(self._sparse_ids, dtype=torch.int64, device=k0.device)
        self._layer_scores: Optional[torch.Tensor] = None
        self._step_scores: Optional[torch.Tensor] = None  # this step's [L_sparse, B, H_q, N] or None
        self._host_rows: list = []  # this step's rows on the host path (eager only)
        self._extra_rows = None  # this step's rows whose input is a per-request boundary
        self._ref_len: Optional[int] = None  # the torch reference's length this step (CPU)
        self._sync_guard = os.environ.get(SYNC_GUARD_ENV) == "1"
        self._fi_plan = None  # the FlashInfer fast path's plan of this step
        self._fast_ws = None  # the fast kernel's window starts of this step (_begin_decode)
        # Asynchronous maintenance: a slow step's Selector + pack run on this side stream,
        # overlapped with the step's later layers, and the next step waits for them
        # (join_maintenance). CUDA only; off by default (sfi_sglang.bench measures it).
        self.side_stream = None
        self._side_pending = False  # side-stream work not yet joined
        self.boundaries = self._boundary_summary(self.cfg.boundaries, 0)  # see install_boundaries
        if self.memory.packed and torch.cuda.is_available():
            from sfi_sglang import graph_if
            from sfi_sglang.step import _HAS_IF_NODE

            # set up outside any capture: a decode graph's slow pass goes under an IF node
            if not (_HAS_IF_NODE or graph_if.available()):
                logger.warning("SFI: no conditional CUDA-graph node here (%s): captured decode steps "
                               "run the slow pass at every step", graph_if.error())
        self.warm_up(self.num_q_heads)
        ACTIVE.append(self)
        logger.info("SFI backend: %s, dense backend %s, sparse memory %.1f MB (%s path)", self.cfg,
                    type(dense_backend).__name__, self.memory.bytes() / 2**20,
                    "kernel" if self.memory.packed else "torch reference")

    def _monitored_layers(self) -> list[int]:
        """The layers the adaptive trigger reads: the sparse layers at 1/4, 1/2 and 3/4 of
        the server's sparse layers (middle layers: the first attend broadly, the last
        follow the output)."""
        sparse = self._sparse_ids
        return sorted({sparse[len(sparse) * k // 4] for k in (1, 2, 3)}) if sparse else []

    def _lse_rows(self, rows: int) -> torch.Tensor:
        """The log-sum-exp buffer's first `rows` rows [layers, rows, H_q]; grown outside a
        capture when an eager step has more rows than request slots."""
        if self._lse.shape[1] < rows:
            if self.memory.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"SFI: a CUDA graph of {rows} rows was captured beyond the "
                                   f"{self._lse.shape[1]} rows of the adaptive trigger's buffer")
            self._lse = torch.full((self._lse.shape[0], rows, self._lse.shape[2]), float("-inf"),
                                   dtype=torch.float32, device=self._lse.device)
        return self._lse[:, :rows]

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
        variant follows the batch or the context (tests/test_kernels.py); what remains is
        the prompt length modulo 16 (Triton's specialization) and whether the context fits
        the budget (top-k takes every key): four lengths cover them (tests/test_bench.py).
        Two requests in slots 1 and 2 (SFI on; SFI off: a dense row) run over the real
        pools before any request exists: req_to_token's rows are still zeros, so every
        position reads KV slot 0 (SGLang's padding slot). The slots are reset afterwards.
        Kernel path (CUDA) only."""
        mem, cfg = self.memory, self.cfg
        sparse = [lid for lid in range(self.num_layers) if lid not in cfg.dense_layers]
        if not mem.packed or not sparse or cfg.method != "sfi" or mem.max_slots < 3:
            return
        lid = sparse[0]
        k_cache = self.token_to_kv_pool.get_key_buffer(lid)
        hkv, d, dev, dtype = k_cache.shape[1], k_cache.shape[2], k_cache.device, k_cache.dtype
        layers = [SimpleNamespace(layer_id=i, tp_q_head_num=num_q_heads, tp_k_head_num=hkv,
                                  qk_head_dim=d, v_head_dim=d, scaling=d ** -0.5)
                  # the last one runs the batched Selector; the adaptive trigger's write their LSE
                  for i in sorted({sparse[0], sparse[-1], *self._lse_layers})]
        layer = layers[0]
        width = self.req_to_token_pool.req_to_token.shape[1]
        long = cfg.sinks + cfg.window + cfg.budget + 32
        lengths = sorted({min(n, width) for n in (511, 496, long - 1, long)})
        zeros = lambda *shape, dt=torch.long: torch.zeros(*shape, dtype=dt, device=dev)
        slots = torch.tensor([1, 2], device=dev)
        try:
            for n in lengths:
                self._start_slot(1, Request(cfg, True))
                self._start_slot(2, Request(cfg, False))
                rows = min(cfg.bootstrap_rows, n)  # a prompt's end: selection from its last rows
                ext = SimpleNamespace(extend_start_loc=zeros(1), extend_seq_lens=torch.tensor([rows]),
                                      req_pool_indices=slots[:1].cpu(), seq_lens=torch.tensor([n]))
                self._bootstrap(zeros(rows, num_q_heads * d, dt=dtype), layer, ext)
                self.step.has_sel[1] = False  # the first decode step: slow (and a dense row)
                fb = SimpleNamespace(out_cache_loc=zeros(2), input_ids=zeros(2), req_pool_indices=slots,
                                     seq_lens=zeros(2) + n, rids=None)
                for _ in range(2):  # slow + dense rows, then fast + dense rows
                    self._begin_decode(fb)
                    k = zeros(2, hkv * d, dt=dtype)
                    for layer_ in layers:
                        self._store_key_norms(k, layer_, fb, True)  # KV slot 0: SGLang's padding
                        self.forward_decode(zeros(2, num_q_heads * d, dt=dtype), k, k, layer_, fb,
                                            save_kv_cache=False)
                    self.join_maintenance()
        finally:
            self.step.rows = None
            for slot in (1, 2):
                self.requests.pop(slot, None)
            mem.reset([1, 2])
            self._resets.clear()

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
        """SGLang gave these slots to new requests (scheduler, host): their device state is
        reset at their first forward (_start_requests), on the forward stream."""
        self._resets.extend(int(s) for s in slots)
        for slot in slots:
            self.requests.pop(slot, None)

    def _slot_config(self, custom_params) -> tuple[bool, SFIConfig]:
        key = json.dumps((custom_params or {}).get("sfi"), sort_keys=True) if isinstance(custom_params, dict) else "null"
        if key not in self._cfg_cache:
            self._cfg_cache[key] = request_config(self.cfg, custom_params)
        return self._cfg_cache[key]

    def _start_slot(self, slot: int, req: Request) -> None:
        """Host: a request's record and its slot's device state (memory, step plan, policy)."""
        self.requests[slot] = req
        self.memory.reset([slot])
        req.host = req.enabled and not on_device_path(req.cfg, self.cfg)
        device_sfi = req.enabled and not req.host
        self.step.start(slot, device_sfi, req.cfg.dense_layers)
        self.policy.reset(torch.tensor([slot]), req.cfg)
        if req.cfg.method == "snapkv":  # selects once (at prefill end), never refreshes
            self.policy.max_interval[slot] = NO_WINDOW
            self.policy.interval_mode[slot] = True
        if not device_sfi:  # a dense row on the device path: the fast kernel reads nothing
            self.memory.fast_ws[slot] = NO_WINDOW

    def suspend(self, rid: str, slot: int) -> None:
        """SGLang retracted the request in `slot` (sfi_sglang.radix: released unfinished). Its
        KV is recomputed by a later prefill, a dense pass over its whole context, so its
        sparse memory cannot survive; its record and decision history (step count, slow
        steps, fast/slow counts) do, and continue when it resumes (_start_requests). Saved
        at the next forward, on the forward stream, before the slot is reused."""
        req = self.requests.get(slot)
        if req is not None and req.rid == rid:
            self._retracted.append((rid, slot, req))

    def _fired(self, slot: int) -> int:
        """Slow steps the adaptive trigger caused in the slot's request (host sync)."""
        return int(self.policy.fired[slot]) if self.policy.fired is not None else 0

    def _save_retracted(self) -> None:
        for rid, slot, req in self._retracted:
            self.suspended[rid] = (req, {**self.step.history(slot), "counts": self.memory.counts[slot].clone(),
                                         "fired": self._fired(slot)})
        self._retracted.clear()

    def _resume(self, slot: int, old: Request, history: dict) -> Request:
        """A retracted request's re-prefill: a new record (its selection is made afresh:
        bootstrap or a shared prefix's memory) that keeps the old one's counters, and its
        decision history, where the re-prefill counts as the decode step it replaces, a
        slow one (dense attention over the whole context, then a new selection)."""
        req = Request(cfg=old.cfg, enabled=old.enabled, rid=old.rid,
                      bootstrap_computed=old.bootstrap_computed, bootstrap_reused=old.bootstrap_reused,
                      retracted_at=(*old.retracted_at, int(history["steps"]) + 1))
        self._start_slot(slot, req)
        counts = history.pop("counts")
        if self.policy.fired is not None:
            self.policy.fired[slot] = history.pop("fired")
        slow = req.enabled and req.refreshes
        self.step.resume(slot, history, slow)
        self.memory.counts[slot] = counts + torch.tensor([0, int(slow)], dtype=counts.dtype,
                                                         device=counts.device)
        return req

    def _start_requests(self, forward_batch):
        """A request's first extend makes its record (a prompt's next chunk keeps it; a
        retracted request's re-prefill resumes its old one); its bootstrap selection
        follows in forward_extend unless a shared prefix's memory is imported here."""
        if self._resets:
            self.memory.reset(self._resets)
            self._resets.clear()
        slots = forward_batch.req_pool_indices.tolist()
        rids = forward_batch.rids or [None] * len(slots)
        prefix_lens = forward_batch.extend_prefix_lens_cpu or [0] * len(slots)
        seq_lens = forward_batch.seq_lens.tolist()
        for slot, rid, prefix, n in zip(slots, rids, prefix_lens, seq_lens):
            old = self.requests.get(slot)
            if old is not None and old.rid == rid and rid is not None:
                continue
            suspended = self.suspended.pop(rid, None) if rid is not None else None
            if suspended is not None:
                req = self._resume(slot, *suspended)
            else:
                enabled, cfg = self._slot_config(REQUEST_PARAMS.get(rid))
                req = Request(cfg=cfg, enabled=enabled, rid=rid)
                self._start_slot(slot, req)
            if rid is not None:
                self.by_rid[rid] = (slot, req)
            if req.enabled and req.refreshes:
                self._share_prefix(slot, req, rid, int(prefix), int(n))

    def export_selection(self, slot: int):
        """(positions [L, H_kv, K], count, hi) of the slot's selection, or None (sfi_sglang.radix)."""
        req = self.requests.get(slot)
        if req is None or not req.enabled or not bool(self.step.has_sel[slot]):
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
        req.bootstrap = req.imported = True
        self.step.has_sel[slot] = True
        req.bootstrap_reused += 1

    # ------------------------------------------------------------------ SGLang's protocol
    def enable_async_maintenance(self, on: bool = True) -> None:
        self.side_stream = torch.cuda.Stream(self.device) if on and torch.cuda.is_available() else None

    def join_maintenance(self) -> None:
        """The current stream waits for the side stream's Selector + pack work (called at
        each forward's start; a captured step must call it before its capture ends)."""
        if self.side_stream is not None and self._side_pending:
            torch.cuda.current_stream(self.device).wait_stream(self.side_stream)
            self._side_pending = False

    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager forward: the dense backend's metadata, then SFI's host and device parts."""
        self.dense.init_forward_metadata(forward_batch)
        self._out_graph(forward_batch)
        self._in_graph(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.dense.init_cuda_graph_state(max_bs, max_num_tokens)
        if self.memory.packed and (self._graph_scores is None or self._graph_scores.shape[0] < max_bs):
            width = self.req_to_token_pool.req_to_token.shape[1]
            self._graph_scores = torch.empty((max_bs, self.num_q_heads, width), dtype=torch.float32,
                                             device=self.memory.device)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        self.dense.init_forward_metadata_out_graph(forward_batch, in_capture)
        self._out_graph(forward_batch)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        self.dense.init_forward_metadata_in_graph(forward_batch)
        self._in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        self.dense.on_after_cuda_graph_warmup()

    def shared_read_ends(self, fm):
        return self.dense.shared_read_ends(fm)

    def _out_graph(self, forward_batch) -> None:
        """Host part of a forward (outside any graph): a decode step's host-path rows (known
        only in eager steps, by their rids) and per-request boundaries; an extend's new
        requests."""
        self.join_maintenance()
        if self._retracted:
            self._save_retracted()
        mode = forward_batch.forward_mode
        self._host_rows = []
        self._fi_plan = None
        if mode.is_decode():
            if not self.memory.packed:  # the torch reference's length: host data (SGLang's)
                lens = getattr(forward_batch, "seq_lens_cpu", None)
                lens = forward_batch.seq_lens if lens is None else lens
                self._ref_len = int(lens.max()) if lens.numel() else 0
            rids = getattr(forward_batch, "rids", None)
            if rids:
                reqs = [self.by_rid.get(rid) for rid in rids]
                self._host_rows = [(i, slot, req) for i, (slot, req) in
                                   ((i, e) for i, e in enumerate(reqs) if e is not None) if req.host]
                self._mark_extra_boundaries(forward_batch)
        elif mode.is_extend() and not mode.is_mixed():
            self._start_requests(forward_batch)

    def _in_graph(self, forward_batch) -> None:
        """Device part (recorded in a decode CUDA graph): the step plan."""
        self.step.rows = None
        if forward_batch.forward_mode.is_decode():
            self._begin_decode(forward_batch)

    def _begin_decode(self, forward_batch) -> None:
        slots = forward_batch.req_pool_indices
        force_dense = None
        if self._host_rows:
            force_dense = torch.zeros(slots.shape[0], dtype=torch.bool)
            force_dense[[i for i, _, _ in self._host_rows]] = True
            force_dense = force_dense.to(slots.device)
        rows = self.step.begin(forward_batch.input_ids, slots, force_dense)
        self._apply_extra_boundaries(slots, rows.slow)
        self.memory.count_steps(slots, rows.on & ~rows.slow, rows.slow)
        # the fast kernel's window starts, gathered once per step: within a step only slow
        # rows store (and change theirs), and their output is the dense pass's
        self._fast_ws = self.memory.step_window_start(slots)
        self._step_scores = self._batched_scores(slots.shape[0])

    def _score_buffer(self, rows: int) -> torch.Tensor:
        """Slow-step logits [rows, H_q, N] float32, N = req_to_token's width (the torch
        reference: this step's longest context). Captured graphs write into the buffer made
        for them (init_cuda_graph_state), which is never replaced: a graph holds no reference
        to the tensors it writes. Eager steps of larger batches get a buffer of their own."""
        if not self.memory.packed:
            return torch.empty((rows, self.num_q_heads, self._ref_len), dtype=torch.float32,
                               device=self.memory.device)
        capturing = self.memory.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        key = "_graph_scores" if capturing or self._graph_scores_for(rows) else "_scores"
        buf = getattr(self, key)
        if buf is None or buf.shape[0] < rows:
            if key == "_graph_scores" and buf is not None:
                raise RuntimeError(f"SFI: a CUDA graph of {rows} rows was captured beyond the "
                                   f"{buf.shape[0]} rows of init_cuda_graph_state")
            width = self.req_to_token_pool.req_to_token.shape[1]
            buf = torch.empty((rows, self.num_q_heads, width), dtype=torch.float32, device=self.memory.device)
            setattr(self, key, buf)
        return buf[:rows]

    def _batched_scores(self, rows: int) -> Optional[torch.Tensor]:
        """[L_sparse, rows, H_q, N] float32 for a step whose Selectors run batched at its end
        (_select_layers), or None: the layer-by-layer path (the torch reference, the side
        stream, baselines, or more than SELECT_BATCH_BYTES of scores). The buffer is made at
        the first use outside a capture for as many rows as fit (at most the request slots)
        and never replaced."""
        if (not self.memory.packed or self.side_stream is not None or not self._sparse_ids
                or self.cfg.method != "sfi"):
            return None
        width = self.req_to_token_pool.req_to_token.shape[1]
        per_row = len(self._sparse_ids) * self.num_q_heads * width
        buf = self._layer_scores
        if buf is None:
            cap = min(SELECT_BATCH_BYTES // (4 * per_row), self.req_to_token_pool.req_to_token.shape[0])
            capturing = self.memory.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if cap < 1 or capturing:
                return None
            buf = self._layer_scores = torch.empty(cap * per_row, dtype=torch.float32, device=self.memory.device)
        if rows * per_row > buf.numel():
            return None
        return buf[:rows * per_row].view(len(self._sparse_ids), rows, self.num_q_heads, width)

    def _graph_scores_for(self, rows: int) -> bool:
        buf = self._graph_scores
        return buf is not None and buf.shape[0] >= rows

    # ------------------------------------------------------------------ forward
    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache=True, **kwargs):
        o = self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self._store_key_norms(k, layer, forward_batch, save_kv_cache)
        mode = forward_batch.forward_mode
        if mode.is_extend() and not mode.is_mixed():
            self._bootstrap(q, layer, forward_batch)
        return o

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache=True, **kwargs):
        """One layer of a decode step: device work only (CUDA-graph capturable), except the
        host-path rows of an eager step."""
        rows, lid = self.step.rows, layer.layer_id
        self._store_key_norms(k, layer, forward_batch, save_kv_cache)
        if rows is None or lid in self.cfg.dense_layers:
            # a layer the server keeps dense: SGLang's own dense decode, then the host-path
            # rows that have a memory there (their own dense_layers)
            o = self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            if rows is not None and self._host_rows:
                ov = o.view(o.shape[0], layer.tp_q_head_num, -1)
                self._host_decode(lid, ov, q.reshape(ov.shape), *self._kv(lid), forward_batch, layer.scaling)
            return o
        if save_kv_cache and k is not None and v is not None:
            self._save_kv(layer, forward_batch, k, v)
        with no_host_reads(self._sync_guard):
            o = self._decode_device(q, lid, rows, forward_batch, layer)
        if self._host_rows:
            self._host_decode(lid, o, q.reshape(o.shape), *self._kv(lid), forward_batch, layer.scaling)
        if self._lse_layers and lid == self._lse_layers[-1]:
            self._observe(rows, forward_batch.req_pool_indices, o.shape[0])
        return o.reshape(o.shape[0], -1)

    def _observe(self, rows, slots, b: int) -> None:
        """The adaptive trigger's verdict for each row's next step, from this step's
        log-sum-exps of the monitored layers (their fast passes, device and host rows). A
        row that keeps a monitored layer dense (its own dense_layers) has no memory there to
        judge: it is not observed."""
        fast = rows.on & ~rows.slow & ~rows.dense.index_select(1, self._lse_t).any(1)
        if self._host_rows:  # eager steps only
            fast = fast.clone()
            for i, _, req in self._host_rows:
                fast[i] = req.enabled and req.cfg.method == "sfi" and not getattr(req, "_slow", True)
        self.policy.observe(slots, self._lse_rows(b), fast)

    def _kv(self, lid):
        pool = self.token_to_kv_pool
        return pool.get_key_buffer(lid), pool.get_value_buffer(lid), self.req_to_token_pool.req_to_token

    def _decode_device(self, q, lid, rows, forward_batch, layer):
        """The device path of one sparse layer: fast attention for every row, then, under
        a conditional node, the dense pass of slow and dense rows and the Selector."""
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        mem, scale = self.memory, layer.scaling
        kc, vc, r2t = self._kv(lid)
        slots, seq_lens = forward_batch.req_pool_indices, forward_batch.seq_lens
        fast_plan = None
        if mem.fast_path == "flashinfer":  # its host plan syncs: eager servers only (engine.py)
            if self._fi_plan is None:
                self._fi_plan = mem.plan_fast("step", slots, seq_lens,
                                              layer.tp_q_head_num // layer.tp_k_head_num, scale)
            fast_plan = self._fi_plan
        k = self._lse_index.get(lid)
        lse = None if k is None else self._lse_rows(q.shape[0])
        o = mem.attend_fast(lid, q, kc, vc, r2t, slots, seq_lens, scale, max_len=self._ref_len,
                            fast_plan=fast_plan, win_start=self._fast_ws,
                            lse_out=None if lse is None else lse[k])
        need, slow_rows = rows.need_l[lid], rows.slow_l[lid]
        batched = self._step_scores

        def dense_pass():
            # rows that are not slow or dense read nothing (length 0); their output stays fast
            lens = torch.where(need, seq_lens, torch.zeros_like(seq_lens))
            out = batched[self._sparse_index[lid]] if batched is not None else self._score_buffer(q.shape[0])
            od, scores = mem.attend_slow(lid, q, kc, vc, r2t, slots, lens, scale, scores_out=out)
            o.copy_(torch.where(need[:, None, None], od, o))
            if batched is not None:
                return  # selected at the step's end, with every layer's (_select_layers)
            side = self.side_stream
            if side is None:
                self._select_decode(lid, slots, slow_rows, scores, seq_lens)
                return
            side.wait_stream(torch.cuda.current_stream(self.device))
            self._side_pending = True
            with torch.cuda.stream(side):
                self._select_decode(lid, slots, slow_rows, scores, seq_lens)
            for t in (scores, seq_lens, slow_rows):  # made on the main stream, used on the side
                t.record_stream(side)

        run_if(rows.need[lid], dense_pass)
        if batched is not None and lid == self._sparse_ids[-1]:
            run_if(rows.any_slow, lambda: self._select_layers(slots, rows, batched, seq_lens))
        return o

    def _host_decode(self, lid, o, q, kc, vc, r2t, forward_batch, scale) -> None:
        """Host-path rows of an eager step (the device path ran them dense): the eval's
        baselines, and requests with their own budget, window or Selector (their slow steps
        follow the policy's decision, their selection their own config)."""
        mem = self.memory
        for i, slot, req in self._host_rows:
            cfg, n = req.cfg, int(forward_batch.seq_lens[i])
            if lid in cfg.dense_layers:
                continue  # dense: what the device path computed
            rpi = forward_batch.req_pool_indices[i:i + 1]
            if req.baseline:
                pos = baseline_positions(cfg, n, q[i], kc, r2t[slot])
                o[i] = mem._attend_positions_ref(q[i:i + 1], kc, vc, r2t, rpi, [pos], scale, None)[0]
                continue
            slow = self._host_slow(slot, req)
            if not slow:
                k = self._lse_index.get(lid)
                lse = None if k is None else self._lse_rows(i + 1)[k, i:i + 1]
                o[i] = mem.attend_fast(lid, q[i:i + 1], kc, vc, r2t, rpi, forward_batch.seq_lens[i:i + 1], scale,
                                       lse_out=lse)[0]
                continue
            _, scores = mem.attend_slow(lid, q[i:i + 1], kc, vc, r2t, rpi, forward_batch.seq_lens[i:i + 1],
                                        scale, max_len=n)
            sl = forward_batch.seq_lens[i:i + 1].to(torch.int64)
            hi = (sl - cfg.window).clamp_min(cfg.sinks)
            lo = torch.full_like(hi, cfg.sinks)
            logits = scores.view(1, mem.num_kv_heads, -1, n)
            pos = self._positions(cfg, logits, self.key_norms[lid], lo, hi, 1, norm_tokens=r2t[rpi, :n])
            mem.store(lid, rpi, pos, (hi - lo).clamp_max(cfg.budget), hi, kc, vc, r2t, seq_lens=sl)

    def _host_slow(self, slot: int, req: Request) -> bool:
        """Whether a host-path request's step is slow (decided once per step, at its first
        sparse layer): the policy's decision for it (StepPlan.begin), or no selection yet."""
        step = int(self.step.steps[slot])
        if getattr(req, "_slow_step", None) != step:
            trig = bool(self.policy.since[slot] == 0) and step > 0
            slow = req.refreshes and (trig if req.cfg.method == "sfi" else not req.has_selection)
            slow = slow or (req.refreshes and not req.has_selection)
            req._slow_step, req._slow = step, slow
            if slow:
                req.has_selection = True
                self.step.slow_log[slot, min(int(self.step.slow_n[slot]), self.step.slow_log.shape[1] - 1)] = step
                self.step.slow_n[slot] += 1
                self.memory.counts[slot, 1] += 1
            else:
                self.memory.counts[slot, 0] += 1
        return req._slow

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
            if req.imported:  # started from a shared prefix's memory
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
            if not req.bootstrap:
                req.bootstrap = req.has_selection = True
                if not req.host:
                    self.step.has_sel[slot] = True

    def _select_decode(self, lid, slots, slow_rows, scores, seq_lens):
        """Slow rows of one layer: the Selector on their dense logits scores [B, H_q, N],
        stored as the layer's new selection (rows that are not slow: no candidates, memory
        unchanged). No host sync, no host-made tensor: CUDA-graph capturable."""
        b, hq, n = scores.shape
        hkv = self.memory.num_kv_heads
        logits = scores.view(b, hkv, hq // hkv, n)
        tokens = self.req_to_token_pool.req_to_token[slots, :n]  # position -> KV slot
        cfg = self.cfg
        hi = (seq_lens.to(torch.int64) - cfg.window).clamp_min(cfg.sinks)
        lo = torch.full_like(hi, cfg.sinks)
        hi = torch.where(slow_rows, hi, lo)
        # the Selector gathers the key norms of the candidates itself (in-kernel on CUDA)
        pos = self._positions(cfg, logits, self.key_norms[lid], lo, hi, 1, norm_tokens=tokens)
        pool = self.token_to_kv_pool
        self.memory.store(lid, slots, pos, (hi - lo).clamp_max(cfg.budget), hi, pool.get_key_buffer(lid),
                          pool.get_value_buffer(lid), self.req_to_token_pool.req_to_token,
                          seq_lens=seq_lens, rows=slow_rows)

    def _select_layers(self, slots, rows, scores, seq_lens):
        """The step's end: the Selector for every sparse layer at once, over their scores
        [L_sparse, B, H_q, N] (rows = layers x requests; the key norms of each layer through
        its offset into the flattened norms), then each layer's store of its slow rows. A
        layer's selection is first read by the next step's fast kernel, and a slow row's
        output at this step is its dense pass's: the same result as selecting layer by layer.
        No host sync."""
        ls, b, hq, n = scores.shape
        cfg, mem = self.cfg, self.memory
        logits = scores.view(ls * b, mem.num_kv_heads, hq // mem.num_kv_heads, n)
        hi = (seq_lens.to(torch.int64) - cfg.window).clamp_min(cfg.sinks)
        slow = rows.slow_l.index_select(0, self._sparse_t)  # [L_sparse, B]
        lo = torch.full((ls * b,), cfg.sinks, dtype=torch.int64, device=hi.device)
        tokens = self.req_to_token_pool.req_to_token[slots, :n]
        norm_tokens = (tokens[None] + self._norm_offsets[:, None, None]).view(ls * b, n)
        norms = self._norms_all.view(-1, self._norms_all.shape[-1])
        pos = select(logits, norms, lo, torch.where(slow, hi, cfg.sinks).view(-1), cfg.budget, 1, cfg,
                     norm_tokens=norm_tokens)
        cnt = (hi - cfg.sinks).clamp_max(cfg.budget)
        pool, r2t = self.token_to_kv_pool, self.req_to_token_pool.req_to_token
        for i, lid in enumerate(self._sparse_ids):
            mem.store(lid, slots, pos[i * b:(i + 1) * b], cnt, hi, pool.get_key_buffer(lid),
                      pool.get_value_buffer(lid), r2t, seq_lens=seq_lens, rows=slow[i])

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

    def _mark_extra_boundaries(self, forward_batch) -> None:
        """Per-request boundaries on top of the server's table (eager steps; host): the
        request's extra boundary ids (custom_params[EXTRA_IDS_KEY]) and grammar-aware
        boundaries (a grammar of sfi_sglang.grammar flags the token that ended a JSON field).
        Such an input token makes the refresh pending after this step, as a table boundary
        does in TriggerPolicy.step (outside the cooldown, not at a slow step):
        _begin_decode applies it."""
        self._extra_rows = None
        rids = forward_batch.rids or []
        info = getattr(forward_batch, "sampling_info", None)
        grammars = (getattr(info, "grammars", None) if info is not None else None) or []
        extra = [(REQUEST_PARAMS.get(rid) or {}).get(EXTRA_IDS_KEY) for rid in rids]
        if not any(extra) and not any(g is not None for g in grammars):
            return  # the common case: no host work
        ids = forward_batch.input_ids.tolist()
        hit = []
        for i in range(len(rids)):
            g = grammars[i] if i < len(grammars) else None
            flagged = bool(getattr(g, "sfi_boundary", False))
            if flagged:
                g.sfi_boundary = False
            if flagged or (extra[i] and ids[i] in extra[i]):
                hit.append(i)
        if hit:
            self._extra_rows = torch.tensor(hit, dtype=torch.int64)

    def _apply_extra_boundaries(self, slots, slow) -> None:
        rows = self._extra_rows
        if rows is None:
            return
        self._extra_rows = None
        pol = self.policy
        rows = rows.to(slots.device)
        s = slots[rows].to(torch.int64)
        pol.pending[s] |= (pol.since[s] > pol.cooldown[s]) & ~slow[rows]

    # ------------------------------------------------------------------ reporting
    def __getattr__(self, name):
        # Extras of the dense backend that SGLang's model code may ask of the backend in
        # use (the base class's methods and flags are ours, see __init__).
        dense = self.__dict__.get("dense")
        if dense is None:
            raise AttributeError(name)
        return getattr(dense, name)

    def request_stats(self, rid: str, finished: bool) -> Optional[dict]:
        """What meta_info["sfi"] reports for a request (host sync: when its output is sent)."""
        if finished:
            REQUEST_PARAMS.pop(rid, None)
            self.suspended.pop(rid, None)  # retracted, then aborted before it resumed
        entry = self.by_rid.pop(rid, None) if finished else self.by_rid.get(rid)
        if entry is None:
            return None
        slot, req = entry
        fast, slow = self.memory.counts[slot].tolist()
        _, slow_at = self.step.read(slot)
        if finished and self.requests.get(slot) is req:
            # SGLang released the request (its memory published to the radix cache) before
            # its last output; the slot's next request makes a new record
            del self.requests[slot]
        stats = req.stats(fast, slow, slow_at)
        if self.policy.fired is not None:
            stats["adaptive_slow_steps"] = self._fired(slot)
        if finished:  # this rank's decision log (sfi_sglang.parallel: TP ranks compared)
            from sfi_sglang import parallel

            parallel.record(rid, stats)
        return stats


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
