"""The Selector: slow-step attention logits -> K positions per KV head
(docs/method.md).

Every step is a plain batched function over
    B: any flattened batch (layers x requests),  H: KV heads,
    R: rows (the G query heads of a GQA group x the captured query rows),
    N: padded positions.
All math runs in float32 on the input's device; no Python loops over B or H.
-inf marks "no mass" (non-candidates, masked logits); no step produces NaN, even for
batch rows with no candidates at all.

Candidate range convention (used by the backend): for a sequence of length n at
selection time, lo = sinks and hi = max(lo, n - window); the selector chooses among
positions [lo, hi). If hi - lo <= k, every candidate is selected, so the sparse
memory (sinks + selected + window) is the whole history.

`Selection` runs the Selector where a selection is made (a prompt's end, a slow row's layer,
or every sparse layer of a slow step at once) and stores the result in the SparseMemory. The
key norms ||k_j|| the prior reads come with the logits: the slow pass computes them from the
keys it reads (kernels/slow_decode.py), so none are kept beside SGLang's pool.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from sfi_sglang.method.baselines import snapkv_select
from sfi_sglang.method.config import SFIConfig

NEG_INF = float("-inf")


# ------------------------------------------------------------------ candidates
def candidate_range(seq_lens: torch.Tensor, sinks: int, window: int):
    """(lo, hi) int64 [B] for sequences of length seq_lens: lo = sinks, hi = max(lo, n - window)."""
    seq_lens = seq_lens.to(torch.int64)
    lo = torch.full_like(seq_lens, sinks)
    hi = torch.maximum(lo, seq_lens - window)
    return lo, hi


def candidate_mask(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n] bool, True at positions lo[b] <= j < hi[b]."""
    j = torch.arange(n, device=lo.device)
    return (j >= lo[:, None]) & (j < hi[:, None])


def _safe_lse(x: torch.Tensor, dim: int) -> torch.Tensor:
    """logsumexp that returns 0 (not -inf) where every entry is -inf, so x - lse stays -inf, not NaN."""
    lse = torch.logsumexp(x, dim=dim, keepdim=True)
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _log_normalize(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x - _safe_lse(x, dim)


# ------------------------------------------------------------------ 1. evidence
def evidence(logits: torch.Tensor, cand_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """log f [B, H, N] from logits [B, H, R, N] over candidates cand_mask [B, N].

    p_r = softmax of row r over the candidates; rows are pooled with the alpha-fair
    power mean log f = (1/a) (logsumexp_r(a log p_r) - log R'), then renormalised.
    alpha < 1e-6 means the geometric mean (mean over rows of log p_r); alpha = 1 is
    the arithmetic mean. Rows with no finite candidate logit (padding rows) are
    ignored and R' counts only the other rows. Non-candidates are -inf.
    """
    x = logits.float().masked_fill(~cand_mask[:, None, None, :], NEG_INF)
    log_p = _log_normalize(x, -1)                                  # [B,H,R,N]
    row_ok = torch.isfinite(log_p).any(-1, keepdim=True)           # [B,H,R,1]
    n_ok = row_ok.sum(-2).clamp_min(1).float()                     # [B,H,1]
    if alpha < 1e-6:
        # geometric mean; padding rows contribute 0 to the sum
        log_f = torch.where(row_ok, log_p, torch.zeros_like(log_p)).sum(-2) / n_ok
        no_rows = ~row_ok.any(-2)                                  # [B,H,1]
        log_f = log_f.masked_fill(~cand_mask[:, None, :] | no_rows, NEG_INF)
    else:
        log_f = (torch.logsumexp(alpha * log_p, dim=-2) - n_ok.log()) / alpha
    return _log_normalize(log_f, -1)


# ------------------------------------------------------------------ 2. structural prior
def structural_prior(key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                     cfg: SFIConfig) -> torch.Tensor:
    """log r [B, H, N] = log softmax over [lo, hi) of w_l2 log pi + w_pos log delta.

    log pi_j = -g log ||k_j|| (norms clamped to >= 1e-6);
    u_j = (j - lo) / (hi - lo - 1) (denominator clamped to >= 1, so hi - lo == 1 gives u = 0);
    log delta_j = -b u_j^p + e log(1 - u_j).
    At the last candidate (u = 1) the spec's log(1 - u) is -inf; we keep it finite by
    clamping 1 - u >= 0.5 / (hi - lo - 1), i.e. half a step beyond the last one, so
    the tail is still the least favoured and the ordering is unchanged.
    """
    n = key_norms.shape[-1]
    j = torch.arange(n, device=key_norms.device, dtype=torch.float32)
    lo_f = lo.to(torch.float32)[:, None]
    denom = (hi - lo - 1).clamp_min(1).to(torch.float32)[:, None]   # [B,1]
    u = ((j[None, :] - lo_f) / denom).clamp(0.0, 1.0)              # [B,N]
    one_minus_u = torch.maximum(1.0 - u, 0.5 / denom)
    log_delta = -cfg.pos_beta * u.pow(cfg.pos_power) + cfg.pos_tail * one_minus_u.log()
    log_pi = -cfg.key_norm_gamma * key_norms.float().clamp_min(1e-6).log()   # [B,H,N]
    z = cfg.w_l2 * log_pi + cfg.w_pos * log_delta[:, None, :]
    z = z.masked_fill(~candidate_mask(lo, hi, n)[:, None, :], NEG_INF)
    return _log_normalize(z, -1)


# ------------------------------------------------------------------ 3. fusion
def fusion_weight(log_f: torch.Tensor, log_r: torch.Tensor, n_rows, cfg: SFIConfig) -> torch.Tensor:
    """Closed-form l* [B, H] = (sum f^2 - sum f r) / sum (f - r)^2, clamped to [0, l_max].

    l_max = lambda_max_single where n_rows == 1, else lambda_max_multi. n_rows is the
    number of captured query rows (tokens, not counting the G heads of a group): an
    int or an int tensor [B]. l* = 0 where f == r (zero denominator).
    """
    f, r = log_f.exp(), log_r.exp()
    sff = (f * f).sum(-1)
    sfr = (f * r).sum(-1)
    den = ((f - r) ** 2).sum(-1)
    lam = torch.where(den > 1e-20, (sff - sfr) / den.clamp_min(1e-20), torch.zeros_like(den))
    if not torch.is_tensor(n_rows):
        # a Python int: no host-to-device copy (keeps select CUDA-graph capturable)
        lam_max = cfg.lambda_max_single if int(n_rows) == 1 else cfg.lambda_max_multi
        return lam.clamp(0.0, lam_max)
    single = (n_rows.to(log_f.device) == 1)
    lam_max = torch.where(single, cfg.lambda_max_single, cfg.lambda_max_multi).float()
    if lam_max.dim() == 1:
        lam_max = lam_max[:, None]
    return torch.minimum(lam.clamp_min(0.0), lam_max)


def fuse(log_f: torch.Tensor, log_r: torch.Tensor, n_rows, cfg: SFIConfig) -> torch.Tensor:
    """Fused score log q [B, H, N] (log_f itself when cfg.use_prior is False).

    arithmetic: q = (1 - l) f + l r   (computed in log space with logaddexp, so the
                ranking of far-tail positions survives float32 underflow);
    geometric:  q ~ f^(1 - l) r^l, renormalised.  Both use the same l* (fusion_weight).
    """
    if not cfg.use_prior:
        return log_f
    lam = fusion_weight(log_f, log_r, n_rows, cfg)[..., None]      # [B,H,1]
    if cfg.fusion == "arithmetic":
        # Python-scalar branches: no host-to-device copy (CUDA-graph capturable)
        a = torch.where(lam < 1, log_f + torch.log1p(-lam), NEG_INF)
        b = torch.where(lam > 0, log_r + lam.log(), NEG_INF)
        return torch.logaddexp(a, b)
    # geometric: guard 0 * -inf where l == 0 (log_r is -inf only off the candidates)
    b = torch.where(lam > 0, lam * log_r, torch.zeros_like(log_r))
    return _log_normalize((1 - lam) * log_f + b, -1)


# ------------------------------------------------------------------ 4. soft NMS
def soft_nms(score: torch.Tensor, radius: int, strength: float) -> torch.Tensor:
    """s'_j = s_j - c * max(0, M_j - s_j), M_j = max over |i - j| <= radius (j included).

    score [B, H, N]; -inf entries stay -inf and never produce NaN.
    """
    if radius <= 0 or strength == 0:
        return score
    b, h, n = score.shape
    m = F.max_pool1d(score.reshape(b * h, 1, n), kernel_size=2 * radius + 1, stride=1,
                     padding=radius).reshape(b, h, n)
    finite = torch.isfinite(score)
    pen = torch.where(finite, (m - score).clamp_min(0.0), torch.zeros_like(score))
    return torch.where(finite, score - strength * pen, score)


# ------------------------------------------------------------------ 5. cross-head exclusivity
def cross_head_exclusivity(score: torch.Tensor, temperature: float, strength: float) -> torch.Tensor:
    """s''_h(j) = s'_h(j) + x log rho_h(j), rho_h(j) = softmax over heads of s'_h(j) / T.

    score [B, H, N]; returned unchanged when H <= 2 (heads are local to a TP rank).
    """
    if score.shape[1] <= 2:
        return score
    log_rho = _log_normalize(score / temperature, 1)
    finite = torch.isfinite(score)
    return torch.where(finite, score + strength * log_rho, score)


# ------------------------------------------------------------------ 6. neighbourhood pooling
def pool_neighbours(score: torch.Tensor, radius: int) -> torch.Tensor:
    """Each candidate's score becomes the max over candidates within +-radius (SnapKV's
    max-pooling of its observation-window scores).

    A strong position lifts its neighbours, so the selection keeps short spans around it
    (the following tokens of a number, a name, a quoted phrase: what copying needs until
    the next refresh) instead of isolated tokens. score [B, H, N]; -inf entries
    (non-candidates) stay -inf and, being -inf, lift nothing.
    """
    if radius <= 0:
        return score
    b, h, n = score.shape
    m = F.max_pool1d(score.reshape(b * h, 1, n), kernel_size=2 * radius + 1, stride=1,
                     padding=radius).reshape(b, h, n)
    return torch.where(score > NEG_INF, m, score)


# ------------------------------------------------------------------ 7. full pipeline
def select_scores(logits: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor,
                  hi: torch.Tensor, n_rows, cfg: SFIConfig) -> torch.Tensor:
    """Final score [B, H, N] (steps 1-6); -inf off the candidate range."""
    cand = candidate_mask(lo, hi, logits.shape[-1])
    s = evidence(logits, cand, cfg.alpha)
    if cfg.use_prior:
        s = fuse(s, structural_prior(key_norms, lo, hi, cfg), n_rows, cfg)
    if cfg.use_nms:
        s = soft_nms(s, cfg.nms_radius, cfg.nms_strength)
    if cfg.use_exclusivity:
        s = cross_head_exclusivity(s, cfg.excl_temperature, cfg.excl_strength)
    return pool_neighbours(s, cfg.pool_radius)


def top_k_positions(score: torch.Tensor, cand_mask: torch.Tensor, k: int, page: int = 1) -> torch.Tensor:
    """Top-k candidate positions per (B, H) -> [B, H, k] int64, sorted ascending.

    Candidates always rank above non-candidates (a candidate whose score is -inf still
    beats a non-candidate), so when fewer than k candidates exist all of them are
    returned first (sorted) and the rest is padded with -1 at the end. page > 1: whole
    pages instead (top_k_pages).
    """
    b, h, n = score.shape
    cand = cand_mask[:, None, :].expand(b, h, n)
    lowest = torch.finfo(torch.float32).min
    key = torch.where(torch.isfinite(score), score.float(), torch.full_like(score, lowest, dtype=torch.float32))
    key = torch.where(cand, key, torch.full_like(key, NEG_INF))
    return top_k_pages(key, k, page) if page > 1 else _top_k_from_key(key, k)


def top_k_pages(key: torch.Tensor, k: int, page: int) -> torch.Tensor:
    """The k // page pages of `page` positions (page j: [j * page, (j + 1) * page)) with the
    highest log-sum-exp of a ranking key [B, H, N] (-inf = never chosen) -> their chosen
    positions [B, H, k] int64, sorted ascending, -1 padded at the end (a page at the edge
    of the candidates gives only its candidates). The budget stays k tokens."""
    b, h, n = key.shape
    pk = F.pad(key, (0, (-n) % page), value=NEG_INF).view(b, h, -1, page)
    ok = pk > NEG_INF
    pages = _top_k_from_key(torch.logsumexp(pk, -1), max(1, k // page))  # [B, H, P]
    pos = pages[..., None] * page + torch.arange(page, device=key.device)  # [B, H, P, page]
    take = (pages[..., None] >= 0) & ok.gather(2, pages.clamp_min(0)[..., None].expand(-1, -1, -1, page))
    big = torch.iinfo(torch.int64).max
    pos = torch.where(take, pos, big).flatten(2).sort(-1).values[..., :k]
    pos = torch.where(pos == big, -1, pos)
    return F.pad(pos, (0, k - pos.shape[-1]), value=-1)


def _top_k_from_key(key: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k of a ranking key [B, H, N] float32 (-inf = never chosen) -> sorted positions
    [B, H, k] int64, -1 padded at the end. No host sync.

    On CUDA: the Triton radix select (kernels/topk.py, no sort, ~9 launches over all SMs);
    elsewhere the torch pipeline below. Same positions; ties at the k-th value go to the
    lowest positions (torch.topk's CUDA rule), -0.0 ranks below +0.0."""
    if key.is_cuda and key.dim() == 3:
        fn = _topk_kernel()
        if fn is not None:
            return fn(key, k)
    return _top_k_from_key_torch(key, k)


_TOPK = []


def _topk_kernel():
    if not _TOPK:
        try:
            from sfi_sglang import kernels

            _TOPK.append(kernels.topk_positions)
        except Exception:  # pragma: no cover - no triton
            _TOPK.append(None)
    return _TOPK[0]


def _top_k_from_key_torch(key: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk + sort version of _top_k_from_key (CPU path, and the reference)."""
    n = key.shape[-1]
    kk = min(k, n)
    # a stable descending sort: ties at the k-th value go to the lowest positions (the
    # Triton top-k's and torch.topk-on-CUDA's rule; torch.topk on the CPU breaks them
    # by the tensor's length), so the selection does not depend on the padded length
    val, idx = torch.sort(key, dim=-1, descending=True, stable=True)
    val, idx = val[..., :kk], idx[..., :kk]
    big = torch.iinfo(torch.int64).max
    idx = torch.where(val > NEG_INF, idx, torch.full_like(idx, big))
    idx = idx.sort(-1).values
    idx = torch.where(idx == big, torch.full_like(idx, -1), idx)
    if kk < k:
        idx = F.pad(idx, (0, k - kk), value=-1)
    return idx


def select(logits: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           k: int, n_rows, cfg: SFIConfig, fused=None) -> torch.Tensor:
    """Selected positions [B, H, k] int64 (sorted ascending, -1 padding at the end).

    logits [B, H, R, N] of the slow step's rows (-inf where masked), key_norms [B, H, N]
    (read on the candidates only), lo/hi [B] the candidate range
    [lo, hi) (see candidate_range), n_rows the number of captured query rows (int or [B]).
    fused: use the Triton pipeline (select_key_fused); default: on CUDA when Triton
    imports. Either way no host sync (CUDA-graph capturable). B may flatten layers x
    requests.
    """
    if fused is None:
        fused = logits.is_cuda and _fused_available()
    if fused:
        key = select_key_fused(logits, key_norms, lo, hi, n_rows, cfg)
        return top_k_pages(key, k, cfg.selection_page) if cfg.selection_page > 1 else _top_k_from_key(key, k)
    score = select_scores(logits, key_norms, lo, hi, n_rows, cfg)
    return top_k_positions(score, candidate_mask(lo, hi, logits.shape[-1]), k, cfg.selection_page)


# ------------------------------------------------------------------ fused GPU path
_FUSED_OK = None


def _fused_available() -> bool:
    global _FUSED_OK
    if _FUSED_OK is None:
        try:
            from sfi_sglang import kernels

            _FUSED_OK = kernels.fused_topk_key is not None
        except Exception:  # pragma: no cover - no triton
            _FUSED_OK = False
    return _FUSED_OK


def select_key_fused(logits: torch.Tensor, key_norms: torch.Tensor, lo: torch.Tensor,
                     hi: torch.Tensor, n_rows, cfg: SFIConfig) -> torch.Tensor:
    """Steps 1-6 + the top-k key of top_k_positions, fused in Triton (kernels/selector.py):
    [B, H, N] float32, s'' on the candidates (float32 lowest where s'' is -inf), -inf off
    them. Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1. No host sync."""
    from sfi_sglang import kernels

    b = logits.shape[0]
    if torch.is_tensor(n_rows):
        single = n_rows.to(logits.device).reshape(-1) == 1
        lam_max = torch.where(single, cfg.lambda_max_single, cfg.lambda_max_multi).float()
        lam_max = lam_max.expand(b).contiguous()
    else:
        lam_max = torch.full((b,), cfg.lambda_max_single if int(n_rows) == 1 else cfg.lambda_max_multi,
                             dtype=torch.float32, device=logits.device)
    return kernels.fused_topk_key(logits, key_norms, lo, hi, lam_max, cfg)


# ------------------------------------------------------------------ where selections are made
# The key norms' dtype: the prior reads 0.5 log ||k||, which bf16's relative error of 2^-9
# moves by 0.001; half of float32's bytes in the slow pass's norm buffers.
NORM_DTYPE = torch.bfloat16


def key_norms(keys: torch.Tensor) -> torch.Tensor:
    """||k|| over the last dim, rounded to NORM_DTYPE as the slow pass writes them: in float32
    on a GPU (as the kernel), in float64 on the CPU (as the torch reference)."""
    wide = torch.float64 if keys.device.type == "cpu" else torch.float32
    return torch.linalg.vector_norm(keys.to(wide), dim=-1).to(NORM_DTYPE)


class Selection:
    """Runs the Selector and stores its positions in `memory`. kv(lid) -> (K, V) buffers of
    the layer, req_to_token maps (slot, position) to KV-pool tokens. With a side stream
    (asynchronous maintenance, CUDA) a layer's Selector and pack overlap the step's later
    layers, and the next forward waits for them (`join`)."""

    def __init__(self, cfg: SFIConfig, memory, kv, req_to_token, sparse_ids: list[int]):
        self.cfg, self.memory, self.kv, self.req_to_token = cfg, memory, kv, req_to_token
        self.sparse_ids = sparse_ids
        self.sparse_t = torch.tensor(sparse_ids, dtype=torch.int64, device=memory.device)
        self.side_stream = None
        self._side_pending = False  # side-stream work not yet joined

    def enable_async(self, on: bool = True) -> None:
        self.side_stream = torch.cuda.Stream(self.memory.device) if on and torch.cuda.is_available() else None

    def join(self) -> None:
        """The current stream waits for the side stream's Selector + pack work (at each
        forward's start; a captured step must call it before its capture ends)."""
        if self.side_stream is not None and self._side_pending:
            torch.cuda.current_stream(self.memory.device).wait_stream(self.side_stream)
            self._side_pending = False

    def positions(self, cfg: SFIConfig, logits, norms, lo, hi, n_rows) -> torch.Tensor:
        """Selected positions [b, H_kv, <= K] (sorted, -1 padded) from logits [b, H_kv, R', N];
        lo, hi [b] int64 tensors on the logits' device; norms as in `select`."""
        if cfg.method == "snapkv":
            out = torch.full((logits.shape[0], logits.shape[1], cfg.budget), -1, dtype=torch.int64)
            for i, (l, h) in enumerate(zip(lo.tolist(), hi.tolist())):
                sel = snapkv_select(logits[i].cpu(), l, h, cfg.budget)
                out[i, :, :sel.shape[1]] = sel
            return out.to(logits.device)
        return select(logits, norms, lo, hi, cfg.budget, n_rows, cfg)

    def bootstrap(self, lid: int, q_rows: torch.Tensor, slot: int, n: int, cfg: SFIConfig,
                  scaling: float) -> None:
        """A prompt's end (chunk) at context length n: select from the logits of its last
        query rows q_rows [R, H_q, D] (host; prefill is eager)."""
        k_cache, v_cache = self.kv(lid)
        rows = q_rows.shape[0]
        lo, hi = cfg.sinks, max(cfg.sinks, n - cfg.window)
        if hi > lo:
            tokens = self.req_to_token[slot, :n].long()
            keys = k_cache[tokens].float()  # [n, H_kv, D]
            hkv = keys.shape[1]
            qg = q_rows.float().reshape(rows, hkv, -1, q_rows.shape[-1])
            logits = torch.einsum("rhgd,nhd->hgrn", qg, keys) * scaling  # [H_kv, G, R, n]
            row_pos = torch.arange(n - rows, n, device=keys.device)
            causal = torch.arange(n, device=keys.device)[None, :] > row_pos[:, None]  # [R, n]
            logits = logits.masked_fill(causal, float("-inf")).reshape(1, hkv, -1, n)
            norms = key_norms(keys).transpose(0, 1)[None]  # [1, H_kv, n]
            bounds = torch.tensor([[lo], [hi]], device=keys.device)
            pos = self.positions(cfg, logits, norms, bounds[0], bounds[1], rows)
        else:
            pos = torch.empty(1, k_cache.shape[1], 0, dtype=torch.int64)
        self.memory.store(lid, [slot], pos, min(cfg.budget, hi - lo), hi, k_cache, v_cache,
                          self.req_to_token, seq_lens=torch.tensor([n]))

    def layer(self, lid: int, slots, slow_rows, scores, norms, seq_lens, cfg: Optional[SFIConfig] = None) -> None:
        """One layer's rows `slow_rows` [B] select from their dense logits scores [B, H_q, N]
        and key norms norms [B, H_kv, >= N] (the slow pass's; other rows: no candidates, memory
        unchanged); `cfg` default the server's. A decode
        step passes its score rows (StepPlan: slots, slow rows and lengths of rows whose
        logits `scores` holds). No host sync, no host-made tensor: CUDA-graph capturable
        (snapkv aside)."""
        cfg = cfg or self.cfg
        b, hq, n = scores.shape
        hkv = self.memory.num_kv_heads
        logits = scores.view(b, hkv, hq // hkv, n)
        lo, hi = candidate_range(seq_lens, cfg.sinks, cfg.window)
        hi = torch.where(slow_rows, hi, lo)
        pos = self.positions(cfg, logits, norms[:, :, :n], lo, hi, 1)
        k_cache, v_cache = self.kv(lid)
        self.memory.store(lid, slots, pos, (hi - lo).clamp_max(cfg.budget), hi, k_cache, v_cache,
                          self.req_to_token, seq_lens=seq_lens, only=slow_rows)

    def layer_maybe_async(self, lid: int, slots, slow_rows, scores, norms, seq_lens) -> None:
        """`layer`, on the side stream when asynchronous maintenance is on."""
        side = self.side_stream
        if side is None:
            self.layer(lid, slots, slow_rows, scores, norms, seq_lens)
            return
        side.wait_stream(torch.cuda.current_stream(self.memory.device))
        self._side_pending = True
        with torch.cuda.stream(side):
            self.layer(lid, slots, slow_rows, scores, norms, seq_lens)
        for t in (scores, norms, seq_lens, slow_rows):  # made on the main stream, used on the side
            t.record_stream(side)

    def layers(self, slots, slow_l, scores, norms, seq_lens) -> None:
        """The step's end: the Selector for every sparse layer at once, over their scores
        [L_sparse, B, H_q, N] and key norms [L_sparse, B, H_kv, >= N] (rows = layers x
        requests), then each layer's store of its slow rows slow_l
        [L, B] (B: the step's score rows, StepPlan). A layer's selection is first read by
        the next step's fast kernel, and a slow
        row's output at this step is its dense pass's: the same result as selecting layer by
        layer. No host sync."""
        ls, b, hq, n = scores.shape
        cfg, mem = self.cfg, self.memory
        logits = scores.view(ls * b, mem.num_kv_heads, hq // mem.num_kv_heads, n)
        lo, hi = candidate_range(seq_lens, cfg.sinks, cfg.window)
        slow = slow_l.index_select(0, self.sparse_t)  # [L_sparse, B]
        lo_all = torch.full((ls * b,), cfg.sinks, dtype=torch.int64, device=hi.device)
        pos = select(logits, norms.view(ls * b, mem.num_kv_heads, -1)[:, :, :n], lo_all,
                     torch.where(slow, hi, cfg.sinks).view(-1), cfg.budget, 1, cfg)
        cnt = (hi - cfg.sinks).clamp_max(cfg.budget)
        for i, lid in enumerate(self.sparse_ids):
            k_cache, v_cache = self.kv(lid)
            mem.store(lid, slots, pos[i * b:(i + 1) * b], cnt, hi, k_cache, v_cache, self.req_to_token,
                      seq_lens=seq_lens, only=slow[i])
