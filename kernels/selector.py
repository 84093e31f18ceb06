"""Fused SFI Selector scores (steps of docs/method.md) in five Triton launches, no host
sync (CUDA-graph capturable). Same math as sfi_sglang/method/selector.py `select_scores`, in
float32, with the per-(b, h) reductions over N done as split partials:

  1. _row_stats     per query row r: max / sum-exp of the logits over the candidates
                    [lo, hi) -> lse_r (one read of the logits).
  2. _evid_prior    log p_r = x - lse_r, pooled over rows (alpha-fair power mean, or the
                    geometric mean for alpha ~ 0) -> unnormalised log f; structural prior
                    z = w_l2 log pi + w_pos log delta -> writes lf, z [B, H, N] and split
                    partials of lse(lf), lse(z), lse(2 lf), lse(lf + z), lse(2 z) (second
                    and last read of the logits).
  3. _fuse          l* from those sums (sum f^2, sum f r, sum r^2 in the log domain),
                    fused score (arithmetic mixture via logaddexp, or geometric) -> s
                    (+ partial lse(s) for the geometric renormalisation).
  4. _nms_excl      one program per (request, block of N) with all H heads: soft NMS
                    (window max from 2*radius+1 shifted L1/L2-resident loads), cross-head
                    exclusivity, and the top-k key: s'' where finite, float32 lowest for
                    candidates whose s'' is -inf, -inf off the candidates.
  5. _pool          step 6 (neighbourhood pooling) on that key, when pool_radius > 0.
The top-k itself is kernels/topk.py.

Bytes at B = 8, H_kv = 8, G = 4, N = 128K (logits 134 MB float32): logits read twice
(268 MB), lf/z/s/key written and read once or twice (~200 MB), key norms (bf16) 17 MB.
"""

import torch
import triton
import triton.language as tl

from ._common import next_pow2, num_sms, split_programs

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
NEG = float("-inf")


@triton.jit
def _lse_combine(m, l):
    """lse (natural log) of split partials (max m, sum exp(x - m) l); -inf when empty."""
    M = tl.max(m, 0)
    Ms = tl.where(M == float("-inf"), 0.0, M)
    tot = tl.sum(l * tl.exp(m - Ms), 0)
    return tl.where(tot > 0, Ms + tl.log(tl.where(tot > 0, tot, 1.0)), float("-inf"))


@triton.jit
def _part(x, mask):
    """(max, sum exp(x - max)) of a 1-D tile, -inf/0 when empty."""
    x = tl.where(mask, x, float("-inf"))
    m = tl.max(x, 0)
    ms = tl.where(m == float("-inf"), 0.0, m)
    return m, tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - ms)), 0)


@triton.jit
def _acc(m_run, l_run, m, l):
    m_new = tl.maximum(m_run, m)
    ms = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, l_run * tl.exp(m_run - ms) + l * tl.exp(m - ms)


@triton.jit
def _row_stats_kernel(Logits, Lo, Hi, Stat_m, Stat_l,
                      stride_lb, stride_lh, stride_lr, H, R, N, CHUNK,
                      BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H
    h = bh % H
    lo = tl.load(Lo + b).to(tl.int32)
    hi = tl.minimum(tl.load(Hi + b).to(tl.int32), N)
    start = tl.maximum(s * CHUNK, lo)
    end = tl.minimum(s * CHUNK + CHUNK, hi)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    base = Logits + b.to(tl.int64) * stride_lb + h * stride_lh + offs_r[:, None] * stride_lr
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        msk = mask_r[:, None] & (offs_n < end)[None, :]
        x = tl.load(base + offs_n[None, :], mask=msk, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(x, 1))
        ms = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.where(x == float("-inf"), 0.0, tl.exp(x - ms[:, None]))
        l_i = l_i * tl.exp(m_i - ms) + tl.sum(p, 1)
        m_i = m_new
    o = (bh * BLOCK_R + offs_r) * BLOCK_S + s
    tl.store(Stat_m + o, m_i, mask=mask_r)
    tl.store(Stat_l + o, l_i, mask=mask_r)


@triton.jit
def _evid_prior_kernel(Logits, Norms, Lo, Hi, Stat_m, Stat_l, LF, Z, Part_m, Part_l,
                       stride_lb, stride_lh, stride_lr, stride_nb, stride_nh, stride_nn,
                       H, R, N, CHUNK,
                       alpha, w_l2g, w_pos, pos_beta, pos_power, pos_tail,
                       GEOMETRIC: tl.constexpr, USE_PRIOR: tl.constexpr,
                       BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1)
    ns = tl.num_programs(1)
    b = bh // H
    h = bh % H
    lo = tl.load(Lo + b).to(tl.int32)
    hi = tl.minimum(tl.load(Hi + b).to(tl.int32), N)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    offs_s = tl.arange(0, BLOCK_S)
    # row lse over all splits
    so = (bh * BLOCK_R + offs_r[:, None]) * BLOCK_S + offs_s[None, :]
    smask = mask_r[:, None] & (offs_s < ns)[None, :]
    sm = tl.load(Stat_m + so, mask=smask, other=float("-inf"))
    sl = tl.load(Stat_l + so, mask=smask, other=0.0)
    M = tl.max(sm, 1)
    Ms = tl.where(M == float("-inf"), 0.0, M)
    tot = tl.sum(sl * tl.exp(sm - Ms[:, None]), 1)
    row_ok = tot > 0
    lse_r = tl.where(row_ok, Ms + tl.log(tl.where(row_ok, tot, 1.0)), 0.0)
    n_ok = tl.maximum(tl.sum(row_ok.to(tl.float32), 0), 1.0)
    any_ok = tl.sum(row_ok.to(tl.int32), 0) > 0
    log_nok = tl.log(n_ok)
    denom = tl.maximum(hi - lo - 1, 1).to(tl.float32)

    base = Logits + b.to(tl.int64) * stride_lb + h * stride_lh + offs_r[:, None] * stride_lr
    nbase = Norms + b.to(tl.int64) * stride_nb + h * stride_nh
    obase = bh.to(tl.int64) * N
    zero = tl.zeros([BLOCK_N], tl.float32)
    m_f = tl.max(zero, 0) + float("-inf")
    l_f = tl.sum(zero, 0)
    m_z, l_z, m_ff, l_ff, m_fz, l_fz, m_zz, l_zz = m_f, l_f, m_f, l_f, m_f, l_f, m_f, l_f
    c0 = s * CHUNK
    c1 = tl.minimum(c0 + CHUNK, N)
    for n0 in range(c0, c1, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_n = offs_n < c1
        cand = in_n & (offs_n >= lo) & (offs_n < hi)
        x = tl.load(base + offs_n[None, :], mask=mask_r[:, None] & cand[None, :],
                    other=float("-inf")).to(tl.float32)
        log_p = x - lse_r[:, None]
        if GEOMETRIC:
            t = tl.where(row_ok[:, None], log_p, 0.0)
            t = tl.where(mask_r[:, None], t, 0.0)
            lf = tl.sum(t, 0) / n_ok
            lf = tl.where(cand & any_ok, lf, float("-inf"))
        else:
            a = alpha * log_p
            am = tl.max(a, 0)
            ams = tl.where(am == float("-inf"), 0.0, am)
            sa = tl.sum(tl.where(a == float("-inf"), 0.0, tl.exp(a - ams[None, :])), 0)
            lse_a = tl.where(sa > 0, ams + tl.log(tl.where(sa > 0, sa, 1.0)), float("-inf"))
            lf = (lse_a - log_nok) / alpha
            lf = tl.where(cand, lf, float("-inf"))
        tl.store(LF + obase + offs_n, lf, mask=in_n)
        mp, lp = _part(lf, cand)
        m_f, l_f = _acc(m_f, l_f, mp, lp)
        if USE_PRIOR:
            nrm = tl.load(nbase + offs_n.to(tl.int64) * stride_nn, mask=cand, other=1.0).to(tl.float32)
            u = tl.minimum(tl.maximum((offs_n - lo).to(tl.float32) / denom, 0.0), 1.0)
            omu = tl.maximum(1.0 - u, 0.5 / denom)
            upow = tl.where(u > 0, tl.exp2(pos_power * tl.log2(tl.where(u > 0, u, 1.0))), 0.0)
            log_delta = -pos_beta * upow + pos_tail * tl.log(omu)
            z = -w_l2g * tl.log(tl.maximum(nrm, 1e-6)) + w_pos * log_delta
            z = tl.where(cand, z, float("-inf"))
            tl.store(Z + obase + offs_n, z, mask=in_n)
            mp, lp = _part(z, cand)
            m_z, l_z = _acc(m_z, l_z, mp, lp)
            mp, lp = _part(2.0 * lf, cand)
            m_ff, l_ff = _acc(m_ff, l_ff, mp, lp)
            mp, lp = _part(lf + z, cand)
            m_fz, l_fz = _acc(m_fz, l_fz, mp, lp)
            mp, lp = _part(2.0 * z, cand)
            m_zz, l_zz = _acc(m_zz, l_zz, mp, lp)
    po = (bh * 8) * BLOCK_S + s
    tl.store(Part_m + po, m_f)
    tl.store(Part_l + po, l_f)
    tl.store(Part_m + po + BLOCK_S, m_z)
    tl.store(Part_l + po + BLOCK_S, l_z)
    tl.store(Part_m + po + 2 * BLOCK_S, m_ff)
    tl.store(Part_l + po + 2 * BLOCK_S, l_ff)
    tl.store(Part_m + po + 3 * BLOCK_S, m_fz)
    tl.store(Part_l + po + 3 * BLOCK_S, l_fz)
    tl.store(Part_m + po + 4 * BLOCK_S, m_zz)
    tl.store(Part_l + po + 4 * BLOCK_S, l_zz)


@triton.jit
def _fuse_kernel(LF, Z, Sc, Part_m, Part_l, LamMax, H, N, CHUNK,
                 USE_PRIOR: tl.constexpr, GEOMETRIC_FUSION: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)
    s = tl.program_id(1)
    b = bh // H
    offs_s = tl.arange(0, BLOCK_S)
    msk = offs_s < tl.num_programs(1)
    pb = (bh * 8) * BLOCK_S
    A = _lse_combine(tl.load(Part_m + pb + offs_s, mask=msk, other=float("-inf")),
                     tl.load(Part_l + pb + offs_s, mask=msk, other=0.0))
    A = tl.where(A == float("-inf"), 0.0, A)
    if USE_PRIOR:
        Bz = _lse_combine(tl.load(Part_m + pb + BLOCK_S + offs_s, mask=msk, other=float("-inf")),
                          tl.load(Part_l + pb + BLOCK_S + offs_s, mask=msk, other=0.0))
        Bz = tl.where(Bz == float("-inf"), 0.0, Bz)
        Lff = _lse_combine(tl.load(Part_m + pb + 2 * BLOCK_S + offs_s, mask=msk, other=float("-inf")),
                           tl.load(Part_l + pb + 2 * BLOCK_S + offs_s, mask=msk, other=0.0))
        Lfz = _lse_combine(tl.load(Part_m + pb + 3 * BLOCK_S + offs_s, mask=msk, other=float("-inf")),
                           tl.load(Part_l + pb + 3 * BLOCK_S + offs_s, mask=msk, other=0.0))
        Lzz = _lse_combine(tl.load(Part_m + pb + 4 * BLOCK_S + offs_s, mask=msk, other=float("-inf")),
                           tl.load(Part_l + pb + 4 * BLOCK_S + offs_s, mask=msk, other=0.0))
        sff = tl.exp(Lff - 2.0 * A)
        sfr = tl.exp(Lfz - A - Bz)
        srr = tl.exp(Lzz - 2.0 * Bz)
        den = sff - 2.0 * sfr + srr
        ok = (den > 1e-20) & (den > 1e-6 * (sff + srr))
        lam = tl.where(ok, (sff - sfr) / tl.where(ok, den, 1.0), 0.0)
        lam = tl.minimum(tl.maximum(lam, 0.0), tl.load(LamMax + b))
    obase = bh.to(tl.int64) * N
    zero = tl.zeros([BLOCK_N], tl.float32)
    m_s = tl.max(zero, 0) + float("-inf")
    l_s = tl.sum(zero, 0)
    c0 = s * CHUNK
    c1 = tl.minimum(c0 + CHUNK, N)
    for n0 in range(c0, c1, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        in_n = offs_n < c1
        log_f = tl.load(LF + obase + offs_n, mask=in_n, other=float("-inf")) - A
        if USE_PRIOR:
            log_r = tl.load(Z + obase + offs_n, mask=in_n, other=float("-inf")) - Bz
            if GEOMETRIC_FUSION:
                bterm = tl.where(lam > 0, lam * log_r, 0.0)
                sc = (1.0 - lam) * log_f + bterm
                mp, lp = _part(sc, in_n)
                m_s, l_s = _acc(m_s, l_s, mp, lp)
            else:
                a = tl.where(lam < 1, log_f + tl.log(1.0 - lam), float("-inf"))
                bb = tl.where(lam > 0, log_r + tl.log(tl.where(lam > 0, lam, 1.0)), float("-inf"))
                mx = tl.maximum(a, bb)
                mn = tl.minimum(a, bb)
                sc = tl.where(mx == float("-inf"), float("-inf"),
                              mx + tl.log(1.0 + tl.exp(mn - mx)))
        else:
            sc = log_f
        tl.store(Sc + obase + offs_n, sc, mask=in_n)
    if GEOMETRIC_FUSION:
        tl.store(Part_m + pb + 5 * BLOCK_S + s, m_s)
        tl.store(Part_l + pb + 5 * BLOCK_S + s, l_s)


@triton.jit
def _nms_excl_kernel(Sc, Key, Part_m, Part_l, Lo, Hi, H, N, radius, nms_c, inv_temp, excl_x,
                     RENORM: tl.constexpr, USE_NMS: tl.constexpr, USE_EXCL: tl.constexpr,
                     BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < N
    lo = tl.load(Lo + b).to(tl.int32)
    hi = tl.load(Hi + b).to(tl.int32)
    cand = in_n & (offs_n >= lo) & (offs_n < hi)
    bh = b * H + offs_h
    base = Sc + bh.to(tl.int64)[:, None] * N
    m2 = mask_h[:, None] & in_n[None, :]
    sc = tl.load(base + offs_n[None, :], mask=m2, other=float("-inf"))
    lse = tl.zeros([BLOCK_H], tl.float32)
    if RENORM:
        offs_s = tl.arange(0, BLOCK_S)
        # columns past the split count hold the buffer's initial (-inf, 0): no split mask
        po = (bh[:, None] * 8 + 5) * BLOCK_S + offs_s[None, :]
        pmv = tl.load(Part_m + po, mask=mask_h[:, None], other=float("-inf"))
        plv = tl.load(Part_l + po, mask=mask_h[:, None], other=0.0)
        M = tl.max(pmv, 1)
        Ms = tl.where(M == float("-inf"), 0.0, M)
        tot = tl.sum(plv * tl.exp(pmv - Ms[:, None]), 1)
        lse = tl.where(tot > 0, Ms + tl.log(tl.where(tot > 0, tot, 1.0)), 0.0)
        sc = sc - lse[:, None]
    fin = sc > float("-inf")
    if USE_NMS:
        mx = sc
        for d in range(0, 2 * radius + 1):
            o = offs_n + d - radius
            v = tl.load(base + o[None, :], mask=mask_h[:, None] & ((o >= 0) & (o < N))[None, :],
                        other=float("-inf"))
            mx = tl.maximum(mx, v - lse[:, None])
        pen = tl.where(fin, tl.maximum(mx - sc, 0.0), 0.0)
        sc = tl.where(fin, sc - nms_c * pen, sc)
    if USE_EXCL:
        t = tl.where(mask_h[:, None], sc * inv_temp, float("-inf"))
        tm = tl.max(t, 0)
        tms = tl.where(tm == float("-inf"), 0.0, tm)
        ts = tl.sum(tl.where(t == float("-inf"), 0.0, tl.exp(t - tms[None, :])), 0)
        lse_t = tl.where(ts > 0, tms + tl.log(tl.where(ts > 0, ts, 1.0)), 0.0)
        sc = tl.where(fin, sc + excl_x * (t - lse_t[None, :]), sc)
    key = tl.where(sc > float("-inf"), sc, -3.4028234663852886e38)
    key = tl.where(cand[None, :], key, float("-inf"))
    tl.store(Key + bh.to(tl.int64)[:, None] * N + offs_n[None, :], key, mask=m2)


@triton.jit
def _pool_kernel(Key, Out, N, radius, BLOCK_N: tl.constexpr):
    """Step 6 on the top-k key: a finite candidate (key above float32 lowest) takes the max
    of the finite candidates within +-radius; other entries are copied."""
    bh = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    base = Key + bh * N
    x = tl.load(base + offs, mask=offs < N, other=float("-inf"))
    fin = x > -3.4028234663852886e38
    mx = x
    for d in range(0, 2 * radius + 1):
        o = offs + d - radius
        v = tl.load(base + o, mask=(o >= 0) & (o < N), other=float("-inf"))
        mx = tl.maximum(mx, tl.where(v > -3.4028234663852886e38, v, float("-inf")))
    tl.store(Out + bh * N + offs, tl.where(fin, mx, x), mask=offs < N)


MAX_SPLITS = 64  # the split partials' width, BLOCK_S: fixed, so no split count builds a new variant


def _num_splits(BH, N, block_n, device):
    target = 8 * num_sms(torch.device(device) if not isinstance(device, torch.device) else device)
    ns = max(1, min(triton.cdiv(N, block_n * 2), triton.cdiv(target, max(1, BH)), MAX_SPLITS))
    return 1 << (ns.bit_length() - 1)


def fused_topk_key(logits, key_norms, lo, hi, lam_max, cfg, block_n=None, workspace=None, upto=4):
    """Top-k key [B, H, N] float32 (see module doc) from logits [B, H, R, N] (any float
    dtype, last dim contiguous), key_norms [B, H, N] (any strides), lo/hi [B] int,
    lam_max [B] float32 (per-row clamp of l*). Same as selector.select_scores + the key of
    selector.top_k_positions, in float32. No host sync. `upto` < 4 stops after that many
    Triton launches (profiling only: the result is then not the key)."""
    B, H, R, N = logits.shape
    dev = logits.device
    key = torch.empty((B, H, N), dtype=torch.float32, device=dev)
    if B == 0 or N == 0 or H == 0:
        return key
    assert logits.stride(3) == 1
    BLOCK_N = block_n or 256
    BLOCK_R = max(2, next_pow2(R))
    NS = _num_splits(split_programs(B, H), N, BLOCK_N, dev)
    CHUNK = triton.cdiv(triton.cdiv(N, NS), BLOCK_N) * BLOCK_N
    BLOCK_S = MAX_SPLITS
    f32 = dict(dtype=torch.float32, device=dev)
    stat_m = torch.empty((B * H, BLOCK_R, BLOCK_S), **f32)
    stat_l = torch.empty((B * H, BLOCK_R, BLOCK_S), **f32)
    part_m = torch.full((B * H, 8, BLOCK_S), NEG, **f32)
    part_l = torch.zeros((B * H, 8, BLOCK_S), **f32)
    lf = torch.empty((B, H, N), **f32)
    z = torch.empty((B, H, N), **f32) if cfg.use_prior else lf
    sc = torch.empty((B, H, N), **f32)
    lo = lo.to(dev)
    hi = hi.to(dev)
    geometric_ev = cfg.alpha < 1e-6
    nw = 4
    _row_stats_kernel[(B * H, NS)](
        logits, lo, hi, stat_m, stat_l, logits.stride(0), logits.stride(1), logits.stride(2),
        H, R, N, CHUNK, BLOCK_S=BLOCK_S, BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, num_warps=nw)
    if upto < 2:
        return key
    _evid_prior_kernel[(B * H, NS)](
        logits, key_norms, lo, hi, stat_m, stat_l, lf, z,
        part_m, part_l, logits.stride(0), logits.stride(1), logits.stride(2), *key_norms.stride(),
        H, R, N, CHUNK,
        float(cfg.alpha if not geometric_ev else 1.0), float(cfg.w_l2 * cfg.key_norm_gamma),
        float(cfg.w_pos), float(cfg.pos_beta), float(cfg.pos_power), float(cfg.pos_tail),
        GEOMETRIC=geometric_ev, USE_PRIOR=bool(cfg.use_prior), BLOCK_S=BLOCK_S,
        BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, num_warps=nw)
    if upto < 3:
        return key
    geo = bool(cfg.use_prior) and cfg.fusion == "geometric"
    _fuse_kernel[(B * H, NS)](
        lf, z, sc, part_m, part_l, lam_max, H, N, CHUNK, USE_PRIOR=bool(cfg.use_prior),
        GEOMETRIC_FUSION=geo, BLOCK_S=BLOCK_S, BLOCK_N=BLOCK_N, num_warps=nw)
    if upto < 4:
        return key
    use_nms = bool(cfg.use_nms) and cfg.nms_radius > 0 and cfg.nms_strength != 0
    use_excl = bool(cfg.use_exclusivity) and H > 2
    BN4 = 128
    _nms_excl_kernel[(B, triton.cdiv(N, BN4))](
        sc, key, part_m, part_l, lo, hi, H, N, int(cfg.nms_radius), float(cfg.nms_strength),
        1.0 / float(cfg.excl_temperature), float(cfg.excl_strength),
        RENORM=geo, USE_NMS=use_nms, USE_EXCL=use_excl, BLOCK_S=BLOCK_S,
        BLOCK_H=max(2, next_pow2(H)), BLOCK_N=BN4, num_warps=4)
    if cfg.pool_radius <= 0:
        return key
    pooled = torch.empty_like(key)
    _pool_kernel[(B * H, triton.cdiv(N, 1024))](key, pooled, N, int(cfg.pool_radius), BLOCK_N=1024, num_warps=4)
    return pooled
