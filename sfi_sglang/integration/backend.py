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

Built like SGLang's own backends: each forward's metadata (sfi_sglang.method.step.
StepMetadata) is made once, before the first layer, in init_forward_metadata or in its
out-graph (host) and in-graph (device, recorded in a decode CUDA graph) halves, and the
layers only read it. Where the state lives:
  - SparseMemory (method.memory): selections, window starts, packed K/V, fast/slow counts;
  - StepPlan (method.step): per-slot switches; it decides on the device, at each decode
    forward, which rows are fast, slow or dense; TriggerPolicy (method.boundary) keeps the
    boundary table and the refresh counters;
  - Selection (method.selector): where selections are made and stored;
  - Slots (integration.slots): each slot's request record, retraction, radix sharing;
  - HostPath (method.baselines): rows the device step cannot serve (eager steps only);
  - StepTopUp (method.topup): the pages a fast step reads besides its memory (--sfi-topup-pages).

A decode step is device work only, with static shapes, so SGLang's decode CUDA graphs
capture it and its overlap scheduler runs it: each sparse layer runs the fast kernel over
every row, then, inside a conditional graph node taken only when some row is slow or dense
at that layer, dense attention with scores for those rows; the Selector runs for every
sparse layer at the step's end (or layer by layer when the scores do not fit).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sfi_sglang.integration import graph_if, state
from sfi_sglang.integration.slots import Slots
from sfi_sglang.integration.warmup import warm_up
from sfi_sglang.method.baselines import HostPath
from sfi_sglang.method.boundary import AdaptiveMonitor, TriggerPolicy, extra_boundary_rows
from sfi_sglang.method.config import SFIConfigError, server_config
from sfi_sglang.method.memory import NO_WINDOW, SparseMemory
from sfi_sglang.method.options import EXTRA_IDS_KEY
from sfi_sglang.method.selector import Selection
from sfi_sglang.method.step import ScoreBuffers, StepMetadata, StepPlan, dense_step, score_rows
from sfi_sglang.method.topup import PageSummaries, StepTopUp

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

# the two decode graphs of each captured batch size under --sfi-dense-below (SFIGraphVariants)
DENSE_VARIANT, SFI_VARIANT = "sfi-dense", "sfi"


class SFIAttnBackend(AttentionBackend):
    """SGLang attention backend `sfi`: wraps the platform's dense backend (prefill and the
    layers every request keeps dense) and implements SGLang's decode CUDA-graph protocol
    for its own decode step."""

    def __init__(self, model_runner, dense_backend):
        self.dense = dense_backend
        # SGLang's runners read the base class's capability flags off the backend: the
        # dense backend's values hold (SFI changes decode attention only)
        for name, value in vars(AttentionBackend).items():
            if not name.startswith("_") and isinstance(value, (bool, int, type(None))):
                setattr(self, name, getattr(dense_backend, name, value))
        self.cfg = cfg = server_config()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        r2t = self.req_to_token_pool.req_to_token
        # --sfi-memory-rows auto as this device runs it (hooks._reserve_sfi_memory agrees)
        self.cfg = cfg = cfg.on_device(r2t.is_cuda)
        mc = model_runner.model_config
        self.num_layers = mc.num_hidden_layers
        args = getattr(model_runner, "server_args", None)
        tp = getattr(args, "tp_size", 1) or 1
        cfg.check_server(tp, getattr(args, "kv_cache_dtype", "auto"))
        self.num_q_heads = max(1, mc.num_attention_heads // tp)
        max_slots = r2t.shape[0]
        k0 = self.token_to_kv_pool.get_key_buffer(0)
        # memory rows: --sfi-memory-rows, auto resolved by the pool SGLang made (the same on
        # every TP rank); 0: one per slot
        rows = cfg.rows_for(self.token_to_kv_pool.size, max_slots)
        self.scaling = _attention_scaling(model_runner, k0.shape[2])
        if k0.dtype.itemsize == 1 and _has_kv_scales(model_runner):
            raise SFIConfigError("SFI reads an fp8 KV cache at unit scales only, and this model loaded "
                                 "KV scales (--quantization-param-path): drop them, use --kv-cache-dtype "
                                 "auto, or serve dense with --disable-sfi")
        # every layer has a row of the memory (a request may make any layer sparse or dense)
        self.memory = SparseMemory(self.num_layers, range(self.num_layers), max_slots,
                                   k0.shape[1], k0.shape[2], cfg, k0.device, k0.dtype,
                                   q_dtype=getattr(mc, "dtype", k0.dtype),
                                   group=max(1, self.num_q_heads // k0.shape[1]),
                                   rows=rows or None)
        self.memory.fast_ws[0] = NO_WINDOW  # slot 0: SGLang's padding rows
        self.policy = _trigger_policy(model_runner, cfg, max_slots, self.device)
        self.step = StepPlan(self.policy, max_slots, self.num_layers, self.device, cfg.max_slow_rows, rows)
        self.sparse_ids = cfg.sparse_layers(self.num_layers)
        self._sparse_index = {lid: i for i, lid in enumerate(self.sparse_ids)}
        self.selection = Selection(cfg, self.memory, self._kv, r2t, self.sparse_ids)
        self.monitor = AdaptiveMonitor(self.policy, self.sparse_ids, max_slots, self.num_q_heads,
                                       k0.device, on=cfg.refresh == "adaptive")
        self.host = HostPath(self.memory, self.policy, self.step, self.selection, self.monitor)
        # the top-up's page summaries where SGLang's pool comes in its pages (--page-size)
        self.summaries = (PageSummaries(cfg.topup_layers(self.num_layers), k0.shape[0], k0.shape[1], k0.shape[2],
                                        cfg.page_size, k0.dtype, k0.device)
                          if PageSummaries.wanted(cfg, getattr(args, "page_size", 1) or 1) else None)
        self.topup = (StepTopUp(self.memory, cfg, self.summaries) if cfg.topup_pages and cfg.method == "sfi"
                      else None)
        self.slots = Slots(cfg, self.memory, self.step, self.policy, self._kv, r2t, self.num_layers)
        self.scores = ScoreBuffers(k0.device, self.memory.packed,
                                   score_rows(max_slots, cfg.max_slow_rows, rows),
                                   len(self.sparse_ids), self.num_q_heads, k0.shape[1],
                                   r2t.shape[1], batched=cfg.method == "sfi")
        self.meta = StepMetadata()
        self._sync_guard = os.environ.get(graph_if.SYNC_GUARD_ENV) == "1"
        self.boundaries = self.policy.table_summary(cfg.boundaries, 0)  # see install_boundaries
        # SGLang resets a slot's state when it gives the slot to a request; the `sfi` radix
        # cache finds the slots on the pool both use (radix.sfi_slots)
        if getattr(self.req_to_token_pool, "_on_alloc_rows", "absent") is None:
            self.req_to_token_pool.register_on_alloc_rows(self.slots.on_alloc_rows)
        self.req_to_token_pool.sfi_slots = self.slots
        # set up outside any capture: a decode graph's slow pass goes under an IF node
        if self.memory.packed and torch.cuda.is_available() and not (graph_if.HAS_IF_NODE or graph_if.available()):
            logger.warning("SFI: no conditional CUDA-graph node here (%s): captured decode steps "
                           "run the slow pass at every step", graph_if.error())
        warm_up(self)
        state.BACKENDS.append(self)
        logger.info("SFI backend: %s, dense backend %s, sparse memory %.1f MB (%s path)", cfg,
                    type(dense_backend).__name__, self.memory.bytes() / 2**20,
                    "kernel" if self.memory.packed else "torch reference")

    def _kv(self, lid: int):
        pool = self.token_to_kv_pool
        return pool.get_key_buffer(lid), pool.get_value_buffer(lid)

    def install_boundaries(self, is_boundary: torch.Tensor, is_content: torch.Tensor,
                           spec: str, version: int) -> None:
        """A new server-wide boundary table (sfi_sglang.router), used from the next step."""
        self.policy.install(is_boundary, is_content)
        self.boundaries = self.policy.table_summary(spec, version)

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch):
        """Eager forward: the dense backend's metadata, then SFI's host and device parts."""
        self.dense.init_forward_metadata(forward_batch)
        self._host_metadata(forward_batch)
        self._device_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        self.dense.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False):
        # Under --sfi-dense-below each batch size is captured twice (SFIGraphVariants, the
        # dense graph first): the dense backend makes its capture-time metadata at the first
        # and plans into it for the second, as for a replay, so both graphs read the same
        # buffers (FlashInfer makes new decode wrappers at every capture, and the first
        # graph would read the freed ones)
        from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_attention_variant

        again = in_capture and self.cfg.dense_below > 0 and get_capture_attention_variant() == SFI_VARIANT
        self.dense.init_forward_metadata_out_graph(forward_batch, in_capture and not again)
        self._host_metadata(forward_batch)
        if in_capture and forward_batch.forward_mode.is_decode():  # replays never plan
            self.memory.plan_fast(forward_batch.req_pool_indices.shape[0], self.scaling)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch):
        self.dense.init_forward_metadata_in_graph(forward_batch)
        self._device_metadata(forward_batch)

    def begin_decode(self, forward_batch) -> None:
        """The metadata of a decode batch that has no host part (the kernel warm-up)."""
        self.meta = StepMetadata()
        self._decode_metadata(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self):
        return self.dense.get_cuda_graph_seq_len_fill_value()

    def on_after_cuda_graph_warmup(self):
        self.dense.on_after_cuda_graph_warmup()

    def shared_read_ends(self, fm):
        return self.dense.shared_read_ends(fm)

    def _host_metadata(self, forward_batch) -> None:
        """Host part of a forward (outside any graph): a new StepMetadata with a decode
        step's host-path rows and per-request boundaries (known only in eager steps, by
        their rids) and the torch reference's length; an extend's new requests."""
        self.selection.join()
        self.slots.begin_forward()
        self.meta = meta = StepMetadata()
        mode = forward_batch.forward_mode
        if mode.is_decode():
            self.slots.claim_rows(forward_batch)  # memory rows for requests that wait for one
            if not self.memory.packed:  # the torch reference's length: host data (SGLang's)
                lens = getattr(forward_batch, "seq_lens_cpu", None)
                lens = forward_batch.seq_lens if lens is None else lens
                meta.ref_len = int(lens.max()) if lens.numel() else 0
            rids = getattr(forward_batch, "rids", None)
            host_rows = self.slots.host_rows(rids) if rids else []
            # host-path rows (eager steps) keep their own memories: such a step stays SFI's
            meta.dense_step = not host_rows and self._dense_step(forward_batch)
            if rids and not meta.dense_step:
                meta.host_rows = host_rows
                if meta.host_rows and not self.memory.packed:
                    meta.host_only = self._host_only(meta.host_rows, len(rids))
                info = getattr(forward_batch, "sampling_info", None)
                grammars = (getattr(info, "grammars", None) if info is not None else None) or []
                extra = [(state.REQUEST_PARAMS.get(rid) or {}).get(EXTRA_IDS_KEY) for rid in rids]
                meta.extra_rows = extra_boundary_rows(forward_batch.input_ids, extra, grammars)
        elif mode.is_extend() and not mode.is_mixed():
            self.slots.start_requests(forward_batch)

    def _dense_step(self, forward_batch) -> bool:
        """Whether this decode step runs the dense backend alone (--sfi-dense-below): while
        a decode graph is captured, the variant being captured says; otherwise the lengths
        do, as SFIGraphVariants.select decides which graph a replay runs."""
        if self.cfg.dense_below <= 0:
            return False
        from sglang.srt.model_executor.runner_utils.capture_mode import get_capture_attention_variant

        variant = get_capture_attention_variant()
        if variant in (DENSE_VARIANT, SFI_VARIANT):
            return variant == DENSE_VARIANT
        return self.graph_variants().select(forward_batch) == DENSE_VARIANT

    def graph_variants(self):
        """SGLang's decode-graph variants for this backend (hooks._sfi_graph_variants), or
        None: one graph per batch size."""
        if self.cfg.dense_below <= 0:
            return None
        return SFIGraphVariants(self.cfg.memory_tokens(), self.cfg.dense_below)

    def _host_only(self, host_rows, batch: int) -> torch.Tensor:
        """[L, B]: the host rows at the layers they do not keep dense, where their own pass
        (HostPath.decode) replaces the device pass, which then skips them (the torch
        reference computes only the rows it reads; the kernels run every row regardless)."""
        mask = torch.zeros(self.num_layers, batch, dtype=torch.bool)
        for i, _, req in host_rows:
            mask[:, i] = True
            mask[list(req.cfg.dense_layers), i] = False
        return mask.to(self.device)

    def _device_metadata(self, forward_batch) -> None:
        """Device part (recorded in a decode CUDA graph)."""
        if forward_batch.forward_mode.is_decode():
            self._decode_metadata(forward_batch)
        else:
            self.meta.rows = None

    def _decode_metadata(self, forward_batch) -> None:
        """A decode step's plan (StepPlan.begin), the fast kernel's window starts (gathered
        once: within a step only slow rows store, and their output is the dense pass's), the
        batched Selector's score buffer and the FlashInfer fast path's list lengths."""
        meta = self.meta
        slots = forward_batch.req_pool_indices
        if meta.dense_step:  # the layers run the dense backend alone (forward_decode)
            s64 = slots.to(torch.int64)
            on = (self.step.sfi[s64] | self.step.waits[s64]) & (slots != 0)
            self.step.skip(slots)
            self.memory.count_steps(slots, torch.zeros_like(on), torch.zeros_like(on), on)
            meta.rows = None
            return
        force_dense = None
        if meta.host_rows:
            force_dense = torch.zeros(slots.shape[0], dtype=torch.bool)
            force_dense[[i for i, _, _ in meta.host_rows]] = True
            force_dense = force_dense.to(slots.device)
        rows = meta.rows = self.step.begin(forward_batch.input_ids, slots, forward_batch.seq_lens, force_dense)
        fast, over = rows.on & ~rows.slow & ~rows.bare, None
        if self.memory.fast_path == "flashinfer":
            self.memory.plan_fast(slots.shape[0], self.scaling)  # host, eager steps: once per size
            meta.fast_plan = lists = self.memory.fast_lists(slots, forward_batch.seq_lens)
            # a fast row whose lists outgrow the planned bound (its request's own max_interval
            # or window beyond the server's) runs this step's sparse layers dense
            over = lists.over & fast
            fast = fast & ~over
            rows.need_l = rows.need_l | over[None, :]
            rows.need = rows.need | over.any()
        if meta.extra_rows is not None:
            self.policy.mark_pending(slots, meta.extra_rows, rows.slow)
        dense = rows.bare if over is None else rows.bare | over
        if self.memory.rows.count is not None:  # SFI rows without a memory row run dense
            dense = dense | self.step.waits[slots.to(torch.int64)]
        self.memory.count_steps(slots, fast, rows.slow, dense, rows.deferred)
        meta.win_start = self.memory.step_window_start(slots)
        batched = self.selection.side_stream is None
        meta.layer_scores = self.scores.step(rows.sel_slots.shape[0]) if batched else None

    # ------------------------------------------------------------------ forward
    def forward_extend(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache=True, **kwargs):
        o = self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None:
            self.summarize(layer.layer_id, forward_batch)
        mode = forward_batch.forward_mode
        if mode.is_extend() and not mode.is_mixed():
            self.bootstrap(q, layer, forward_batch)
        return o

    def bootstrap(self, q, layer, forward_batch) -> None:
        """End of a prompt (chunk): each request selects from the logits of its last query rows."""
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        lid = layer.layer_id
        for slot, req, start, rows, n in self.slots.bootstraps(lid, forward_batch):
            self.selection.bootstrap(lid, q[start:start + rows], slot, n, req.cfg, layer.scaling)
            self.slots.bootstrapped(slot, req)

    def forward_decode(self, q, k, v, layer: RadixAttention, forward_batch: ForwardBatch,
                       save_kv_cache=True, **kwargs):
        """One layer of a decode step: device work only (CUDA-graph capturable), except the
        host-path rows of an eager step."""
        meta, lid = self.meta, layer.layer_id
        rows = meta.rows
        if rows is None or lid in self.cfg.dense_layers:
            # a layer the server keeps dense: SGLang's own dense decode, then the host-path
            # rows that have a memory there (their own dense_layers)
            o = self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
            if save_kv_cache and k is not None:
                self.summarize(lid, forward_batch)
            if rows is not None and meta.host_rows:
                ov = o.view(o.shape[0], layer.tp_q_head_num, -1)
                self._host_decode(lid, ov, q.reshape(ov.shape), forward_batch, layer.scaling)
            return o
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v)
            self.summarize(lid, forward_batch)
        with graph_if.no_host_reads(self._sync_guard):
            o = self._decode_device(q, lid, forward_batch, layer)
        if meta.host_rows:
            self._host_decode(lid, o, q.reshape(o.shape), forward_batch, layer.scaling)
        if self.monitor.layers and lid == self.monitor.layers[-1]:
            self.monitor.observe(rows, forward_batch.req_pool_indices, o.shape[0],
                                 self.host.fast_rows(meta.host_rows))
        return o.reshape(o.shape[0], -1)

    def summarize(self, lid: int, forward_batch) -> None:
        """After layer lid's keys were written: the top-up's page summaries of their pages."""
        if self.summaries is not None:
            self.summaries.store(lid, self._kv(lid)[0], forward_batch.out_cache_loc)

    def _host_decode(self, lid, o, q, forward_batch, scale) -> None:
        kc, vc = self._kv(lid)
        self.host.decode(lid, o, q, kc, vc, self.req_to_token_pool.req_to_token, forward_batch, scale,
                         self.meta.host_rows)

    def _decode_device(self, q, lid, forward_batch, layer):
        """The device path of one sparse layer: fast attention for every row, then, under
        a conditional node, the dense pass of slow and dense rows; the Selector (for every
        sparse layer at once at the last one, or here layer by layer)."""
        meta, mem, scale = self.meta, self.memory, layer.scaling
        rows = meta.rows
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        kc, vc = self._kv(lid)
        r2t = self.req_to_token_pool.req_to_token
        slots, seq_lens = forward_batch.req_pool_indices, forward_batch.seq_lens
        need, batched = rows.need_l[lid], meta.layer_scores
        fast_lens = seq_lens
        if meta.host_only is not None:  # length 0: the reference skips them
            fast_lens = torch.where(meta.host_only[lid], torch.zeros_like(seq_lens), seq_lens)
            need = need & ~meta.host_only[lid]
        extra = None if self.topup is None else self.topup.pages(lid, q, kc, r2t, slots, fast_lens)
        o = mem.attend_fast(lid, q, kc, vc, r2t, slots, fast_lens, scale, max_len=meta.ref_len,
                            fast_plan=meta.fast_plan, win_start=meta.win_start,
                            lse_out=self.monitor.out(lid, q.shape[0]), extra=extra)

        def dense_pass():
            # rows that are not slow or dense read nothing (length 0); their output stays
            # fast. Slow rows write their logits to their score rows (rows.score_row)
            lens = torch.where(need, seq_lens, torch.zeros_like(seq_lens))
            i = self._sparse_index[lid]
            out, norms_out = ((batched[0][i], batched[1][i]) if batched is not None
                              else self.scores.layer(rows.sel_slots.shape[0], meta.ref_len))
            od, scores, norms = mem.attend_slow(lid, q, kc, vc, r2t, slots, lens, scale, scores_out=out,
                                                norms_out=norms_out, score_rows=rows.score_row)
            o.copy_(torch.where(need[:, None, None], od, o))
            if batched is None:
                self.selection.layer_maybe_async(lid, rows.sel_slots, rows.sel_l[lid], scores, norms,
                                                 rows.sel_lens)

        graph_if.run_if(rows.need[lid], dense_pass)
        if batched is not None and lid == self.sparse_ids[-1]:
            graph_if.run_if(rows.any_slow, lambda: self.selection.layers(rows.sel_slots, rows.sel_l, *batched,
                                                                         rows.sel_lens))
        return o


@dataclass(frozen=True)
class SFIGraphVariants:
    """SGLang's AttentionGraphVariants protocol (sglang.srt.layers.attention.graph_variants)
    for --sfi-dense-below: SGLang's decode graph runner captures, per batch size, a graph of
    the dense step (the dense backend alone) and one of SFI's, and each replay runs the one
    `select` names, from SGLang's host copy of the lengths (as it does for DSA's dense and
    sparse decode graphs)."""

    memory_tokens: int
    below: int
    # the dense graph first: SFI's capture peak covers its share of the graph memory pool
    capture_labels: ClassVar[tuple[str, ...]] = (DENSE_VARIANT, SFI_VARIANT)

    def select(self, forward_batch) -> str:
        lens = getattr(forward_batch, "seq_lens_cpu", None)
        return DENSE_VARIANT if dense_step(lens, self.memory_tokens, self.below) else SFI_VARIANT


def _attention_scaling(model_runner, head_dim: int) -> float:
    """The model's attention scale (its RadixAttention layers'; the FlashInfer fast path
    plans with it once per step), else head_dim ** -0.5."""
    from sglang.srt.layers.radix_attention import RadixAttention

    model = getattr(model_runner, "model", None)
    for m in (model.modules() if model is not None else ()):
        if isinstance(m, RadixAttention):
            return float(m.scaling)
    return head_dim ** -0.5


def _has_kv_scales(model_runner) -> bool:
    """Whether a RadixAttention layer of the model holds KV scales (loaded for an fp8 KV
    cache from --quantization-param-path; without them SGLang reads fp8 at unit scales)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    model = getattr(model_runner, "model", None)
    return any(isinstance(m, RadixAttention) and (m.k_scale is not None or m.v_scale is not None)
               for m in (model.modules() if model is not None else ()))


def _trigger_policy(model_runner, cfg, max_slots: int, device) -> TriggerPolicy:
    """The refresh trigger, with the server's boundary table from the model's tokenizer."""
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    args = model_runner.server_args
    tokenizer = get_tokenizer(args.tokenizer_path or args.model_path, trust_remote_code=args.trust_remote_code)
    return TriggerPolicy.from_tokenizer(tokenizer, cfg, max_slots=max_slots,
                                        vocab_size=model_runner.model_config.vocab_size, device=device)
