"""SFI kernel check + benchmark on one H200, in one call (see bench/NOTES.md).

Run on the device machine from the repo root (no sglang needed):
    source bench/layout.sh; sfi_site /tmp/sfi-site; PYTHONUNBUFFERED=1 python3 -P bench/kernels_h200.py --out $OUT

Does:
  1. HBM copy bandwidth (device-to-device copy, bytes read + written).
  2. Correctness vs float64 references: small ragged GQA shapes (fp32/fp16/bf16) and
     real Qwen3-4B shapes (H_q=32, H_kv=8, D=128, bf16).
  3. Timing at N in {8K, 32K, 128K} x B in {1, 8}: dense SDPA baseline, our dense
     kernel with and without scores, the fast kernel (P = 2052 packed + 256 window),
     pack, the torch Selector (if sfi_sglang/method/selector.py imports), key-norm store.
     Each op is timed two ways: triton.testing.do_bench median (L2 flushed before every
     rep) and CUDA-graph replays of many calls rotating over input sets whose total
     size exceeds 4x L2 (the number reported as primary).
Writes kernels_h200.json and kernels_h200.png to --out, prints a table last.
"""

import argparse
import json
import math
import os
import pathlib
import statistics
import time
import traceback

if os.environ.get("SFI_BENCH_SMOKE") == "1":  # must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

REPO = pathlib.Path(__file__).resolve().parents[1]


def load_kernels():
    from sfi_sglang import kernels

    return kernels


def load_selector():
    import sfi_sglang.method.config as config  # noqa
    import sfi_sglang.method.selector as selector  # noqa
    return selector, config


def load_memory():
    import sfi_sglang.method.memory as memory  # noqa
    return memory


SMOKE = os.environ.get("SFI_BENCH_SMOKE") == "1"  # CPU interpreter dry run of the script
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
K = load_kernels()
DEV = "cpu" if SMOKE else "cuda"
# real Qwen3-4B shapes; SMOKE shrinks them so the script's plumbing can be tried on a CPU
DIMS = dict(Hkv=8, G=4, D=128, S=4, W=256, Kc=2048)
if SMOKE:
    DIMS = dict(Hkv=2, G=4, D=32, S=4, W=32, Kc=48)
RESULTS = {"checks": [], "timings": [], "errors": []}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref)).item()


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------ timing helpers
def bench_do(fn):
    if SMOKE:
        fn()
        return 1.0
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fns, est_ms, target_ms=3.0, max_calls=400, replays=15):
    """Median per-call ms of a CUDA graph holding n calls that cycle through fns."""
    n = len(fns)
    if SMOKE:
        for f in fns:
            f()
        return 1.0, n
    calls = max(n, min(max_calls, int(math.ceil(target_ms / max(est_ms, 1e-3)))))
    calls = int(math.ceil(calls / n) * n)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % n]()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / calls)
    del g
    return statistics.median(ts), calls


def timed(name, cfg, fns, bytes_moved=None, graph=True):
    rec = {"op": name, **cfg}
    try:
        it = [0]

        def rot():
            f = fns[it[0] % len(fns)]
            it[0] += 1
            f()

        t_do = bench_do(rot)
        rec["do_bench_ms"] = t_do
        if graph:
            try:
                t_g, calls = bench_graph(fns, t_do)
                rec["graph_ms"] = t_g
                rec["graph_calls"] = calls
            except Exception as e:  # not capturable
                rec["graph_error"] = repr(e)[:300]
                torch.cuda.synchronize()
        rec["ms"] = rec.get("graph_ms", t_do)
        if bytes_moved:
            rec["bytes"] = bytes_moved
            rec["GBps"] = bytes_moved / (rec["ms"] * 1e-3) / 1e9
    except Exception as e:
        rec["error"] = repr(e)[:500]
        RESULTS["errors"].append(f"{name} {cfg}: {traceback.format_exc()[-1500:]}")
        torch.cuda.synchronize()
    RESULTS["timings"].append(rec)
    log(f"  {name:28s} {json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items() if k not in cfg})}")
    return rec


def check(name, err, tol, **kw):
    ok = (err == err) and err < tol
    RESULTS["checks"].append({"check": name, "rel_err": err, "tol": tol, "ok": bool(ok), **kw})
    log(f"  check {name:50s} rel_err={err:.3e} tol={tol:.0e} {'OK' if ok else 'FAIL'}")
    return ok


# ----------------------------------------------------------------------- state builders
def build_state(B, Hkv, G, D, N, dtype, n_sets, P, window, contiguous=True, seed=0):
    """n_sets disjoint copies (rotation sets) of B requests of length N in a token-slot KV
    pool. Pool slot of (set r, request b) = r*B + b, KV slots of it = [(r*B+b)*N, +N)."""
    torch.manual_seed(seed)
    R = n_sets * B
    num_slots = R * N
    k_cache = torch.randn(num_slots, Hkv, D, device=DEV, dtype=dtype)
    v_cache = torch.randn(num_slots, Hkv, D, device=DEV, dtype=dtype)
    base = torch.arange(R, device=DEV, dtype=torch.int32)[:, None] * N
    if contiguous:
        req_to_token = base + torch.arange(N, device=DEV, dtype=torch.int32)[None, :]
    else:
        req_to_token = base + torch.argsort(torch.rand(R, N, device=DEV), dim=1).int()
    packed_k = torch.randn(R, Hkv, P, D, device=DEV, dtype=dtype)
    packed_v = torch.randn(R, Hkv, P, D, device=DEV, dtype=dtype)
    packed_len = torch.full((R,), P, device=DEV, dtype=torch.int32)
    sets = []
    for r in range(n_sets):
        rpi = torch.arange(r * B, (r + 1) * B, device=DEV, dtype=torch.int64)
        sets.append(dict(
            q=torch.randn(B, Hkv * G, D, device=DEV, dtype=dtype),
            req_pool_indices=rpi,
            seq_lens=torch.full((B,), N, device=DEV, dtype=torch.int32),
            win_start=torch.full((B,), N - window, device=DEV, dtype=torch.int32),
            out=torch.empty(B, Hkv * G, D, device=DEV, dtype=dtype),
        ))
    return dict(k_cache=k_cache, v_cache=v_cache, req_to_token=req_to_token, packed_k=packed_k,
                packed_v=packed_v, packed_len=packed_len, sets=sets)


def random_positions(B, Hkv, N, S, Kc, window, device=DEV):
    """[B,H_kv,S+Kc] int32: sinks then Kc sorted distinct positions in [S, N-window)."""
    hi = N - window
    sel = torch.rand(B, Hkv, hi - S, device=device).topk(Kc, dim=-1).indices.sort(-1).values + S
    sinks = torch.arange(S, device=device).expand(B, Hkv, S)
    return torch.cat([sinks, sel], -1).int().contiguous()


# ----------------------------------------------------------------------- correctness
def correctness():
    log("== correctness vs float64 references")
    ok = True
    # small ragged shapes, several dtypes and GQA groups
    dts = ((torch.float32, 1e-4), (torch.float16, 5e-3), (torch.bfloat16, 2e-2))
    for dtype, tol in (dts[:1] if SMOKE else dts):
        # all GQA groups in bf16 (the real dtype); G=4 only for fp32/fp16 (fewer compiles)
        for G in ((1, 3) if SMOKE else ((1, 3, 4, 8) if dtype == torch.bfloat16 else (4,))):
            torch.manual_seed(G)
            B, Hkv, D, P = 3, 2, 128, 96
            seq_lens = [700, 150, 61]
            N = max(seq_lens)
            num_slots = sum(seq_lens) + 5
            k_cache = torch.randn(num_slots, Hkv, D, device=DEV, dtype=dtype)
            v_cache = torch.randn(num_slots, Hkv, D, device=DEV, dtype=dtype)
            rpi = torch.tensor([4, 0, 2], device=DEV)
            rtt = torch.zeros(6, N, dtype=torch.int32, device=DEV)
            perm = torch.randperm(num_slots, device=DEV).int()
            off = 0
            for b, n in enumerate(seq_lens):
                rtt[rpi[b], :n] = perm[off:off + n]
                off += n
            sl = torch.tensor(seq_lens, device=DEV, dtype=torch.int32)
            q = torch.randn(B, Hkv * G, D, device=DEV, dtype=dtype)
            ws = torch.tensor([700 - 300, 150 - 40, 0], device=DEV, dtype=torch.int32)
            positions = torch.full((B, Hkv, P), -1, device=DEV, dtype=torch.int32)
            pl = torch.zeros(6, dtype=torch.int32, device=DEV)
            for b in range(B):
                hi = int(ws[b])
                k = min(P, hi)
                for h in range(Hkv):
                    positions[b, h, :k] = torch.randperm(hi, device=DEV)[:k].sort().values.int()
                pl[rpi[b]] = k
            pk = torch.full((6, Hkv, P, D), float("nan"), device=DEV, dtype=dtype)
            pv = torch.full_like(pk, float("nan"))
            rk, rv = pk.clone(), pv.clone()
            K.pack(k_cache, v_cache, rtt, rpi, positions, pk, pv)
            K.ref_pack(k_cache, v_cache, rtt, rpi, positions, rk, rv)
            same = torch.equal(torch.nan_to_num(pk), torch.nan_to_num(rk)) and torch.equal(
                torch.isnan(pv), torch.isnan(rv)) and torch.equal(torch.nan_to_num(pv), torch.nan_to_num(rv))
            ok &= check(f"pack small {dtype} G={G}", 0.0 if same else 1.0, 0.5)
            for splits in ((1, 4, None) if (G == 4 or SMOKE) else (1, 4)):
                ref = K.ref_fast_decode(q, k_cache, v_cache, rtt, rpi, sl, ws, pk, pv, pl, D ** -0.5)
                for fused in ((False, True) if splits != 1 else (False,)):
                    out = torch.full_like(q, float("nan"))
                    K.fast_decode(q, k_cache, v_cache, rtt, rpi, sl, ws, pk, pv, pl, D ** -0.5,
                                  out=out, num_splits=splits, fused_reduce=fused)
                    e = rel_err(out, ref) if torch.isfinite(out).all() else float("nan")
                    ok &= check(f"fast small {dtype} G={G} splits={splits} fused={fused}", e, tol)
                sc = torch.full((B, Hkv * G, N + 37), float("nan"), device=DEV)
                nm = torch.full((B, Hkv, N + 37), float("nan"), device=DEV)
                rn = nm.clone()
                out = torch.full_like(q, float("nan"))
                K.dense_decode_with_scores(q, k_cache, v_cache, rtt, rpi, sl, D ** -0.5,
                                           scores_out=sc, out=out, num_splits=splits, norms_out=nm)
                ro, rs = K.ref_dense_decode_with_scores(q, k_cache, v_cache, rtt, rpi, sl, D ** -0.5,
                                                        n_max=N + 37, norms_out=rn)
                live = torch.arange(N + 37, device=DEV)[None, None, :] < sl.view(-1, 1, 1)
                ok &= check(f"dense+scores key norms small {dtype} G={G} splits={splits}",
                            rel_err(nm[live.expand_as(nm)], rn[live.expand_as(rn)]), 1e-6)
                e = rel_err(out, ro) if torch.isfinite(out).all() else float("nan")
                ok &= check(f"dense+scores out small {dtype} G={G} splits={splits}", e, tol)
                fin = torch.isfinite(rs)
                good = (not torch.isnan(sc).any()) and torch.equal(torch.isfinite(sc), fin)
                e = rel_err(sc[fin], rs[fin]) if good else float("nan")
                ok &= check(f"dense+scores scores small {dtype} G={G} splits={splits}", e,
                            1e-4 if dtype == torch.float32 else 1e-5 * 100)
    return ok


def correctness_real(N, B):
    """Real Qwen3-4B shapes, bf16."""
    Hkv, G, D, S, W, Kc = (DIMS[k] for k in ("Hkv", "G", "D", "S", "W", "Kc"))
    P = S + Kc
    st = build_state(B, Hkv, G, D, N, torch.bfloat16, 1, P, W, contiguous=False, seed=N + B)
    s0 = st["sets"][0]
    positions = random_positions(B, Hkv, N, S, Kc, W)
    pk = torch.full_like(st["packed_k"], float("nan"))
    pv = torch.full_like(st["packed_v"], float("nan"))
    K.pack(st["k_cache"], st["v_cache"], st["req_to_token"], s0["req_pool_indices"], positions, pk, pv)
    ok = check(f"pack real N={N} B={B}", 0.0 if not torch.isnan(pk).any() and not torch.isnan(pv).any() else 1.0, 0.5)
    rk, rv = torch.zeros_like(pk), torch.zeros_like(pv)
    K.ref_pack(st["k_cache"], st["v_cache"], st["req_to_token"], s0["req_pool_indices"], positions, rk, rv)
    ok &= check(f"pack real exact N={N} B={B}", 0.0 if torch.equal(pk, rk) and torch.equal(pv, rv) else 1.0, 0.5)
    args = (s0["q"], st["k_cache"], st["v_cache"], st["req_to_token"], s0["req_pool_indices"],
            s0["seq_lens"], s0["win_start"], pk, pv, st["packed_len"], D ** -0.5)
    out = torch.full_like(s0["q"], float("nan"))
    K.fast_decode(*args, out=out)
    ref = K.ref_fast_decode(*args)
    ok &= check(f"fast real bf16 N={N} B={B}", rel_err(out, ref) if torch.isfinite(out).all() else float("nan"), 1e-2)
    for fused in (False, True):
        for splits, bn in ((8, 128), (16, 64), (32, 64)):
            outs = []
            for _ in range(20):
                o = torch.full_like(s0["q"], float("nan"))
                K.fast_decode(*args, out=o, num_splits=splits, block_n=bn, fused_reduce=fused)
                outs.append(o)
            torch.cuda.synchronize() if not SMOKE else None
            e = max(rel_err(o, ref) if torch.isfinite(o).all() else float("nan") for o in outs)
            same = all(torch.equal(o, outs[0]) for o in outs)
            ok &= check(f"fast real bf16 N={N} B={B} s={splits} bn={bn} fused={fused} x20 "
                        f"{'bitwise-same' if same else 'DIFFERENT'}", e if same else float("nan"), 1e-2)
    # SFI == dense when the selected set is the whole candidate range: compare fast to a
    # dense reference restricted to the sparse positions (done implicitly above); also the
    # dense kernel + scores against float64:
    sc = torch.full((B, Hkv * G, N), float("nan"), device=DEV)
    out = torch.full_like(s0["q"], float("nan"))
    K.dense_decode_with_scores(s0["q"], st["k_cache"], st["v_cache"], st["req_to_token"],
                               s0["req_pool_indices"], s0["seq_lens"], D ** -0.5, scores_out=sc, out=out)
    ro, rs = K.ref_dense_decode_with_scores(s0["q"], st["k_cache"], st["v_cache"], st["req_to_token"],
                                            s0["req_pool_indices"], s0["seq_lens"], D ** -0.5)
    ok &= check(f"dense+scores out real bf16 N={N} B={B}", rel_err(out, ro) if torch.isfinite(out).all() else float("nan"), 1e-2)
    ok &= check(f"dense+scores scores real bf16 N={N} B={B}", rel_err(sc, rs) if not torch.isnan(sc).any() else float("nan"), 1e-4)
    # SDPA baseline sanity
    kc = st["k_cache"][st["req_to_token"][:B].long()].permute(0, 2, 1, 3).contiguous()
    vc = st["v_cache"][st["req_to_token"][:B].long()].permute(0, 2, 1, 3).contiguous()
    o = F.scaled_dot_product_attention(s0["q"][:, :, None], kc, vc, enable_gqa=True, scale=D ** -0.5)[:, :, 0]
    ok &= check(f"sdpa baseline real bf16 N={N} B={B}", rel_err(o, ro), 1e-2)
    del st, kc, vc, sc, rs
    torch.cuda.empty_cache()
    return ok


def correctness_memory_selector(memory_mod, selector_mod, cfg_mod):
    """SparseMemory kernel path (packed) vs its torch reference path (packed=False) on the
    same CUDA inputs; fast == dense when every candidate is selected; the fused Selector vs
    the torch Selector (score error, positions agreement)."""
    log("== SparseMemory + fused Selector correctness")
    Hkv, G, D, S, W, Kc = (DIMS[k] for k in ("Hkv", "G", "D", "S", "W", "Kc"))
    ok = True
    for N, B, full in (((4096, 4, False), (2000, 3, True)) if not SMOKE else ((300, 2, False), (60, 2, True))):
        st = build_state(B, Hkv, G, D, N, torch.bfloat16, 1, S + Kc, W, contiguous=False, seed=N)
        s0 = st["sets"][0]
        rpi = s0["req_pool_indices"]
        lens = torch.tensor([N - 3 * b for b in range(B)], device=DEV, dtype=torch.int32)
        n_sel = lens - 2                                    # selected 2 steps ago
        cfg = cfg_mod.SFIConfig(sinks=S, window=W, budget=Kc, dense_layers=())
        lo, hi = selector_mod.candidate_range(n_sel, S, W)
        mem_args = (1, [0], B, Hkv, D, cfg, DEV, torch.bfloat16)
        mems = [memory_mod.SparseMemory(*mem_args, packed=p) for p in (False, True)]
        if full:
            c = torch.clamp(hi - lo, max=Kc)
            pos = (torch.arange(Kc, device=DEV)[None, None, :] + S).expand(B, Hkv, Kc).contiguous()
            pos = torch.where(torch.arange(Kc, device=DEV)[None, None, :] < c[:, None, None], pos, -1)
        else:
            scores = torch.randn(B, Hkv, 1, N, device=DEV)
            norms = torch.rand(B, Hkv, N, device=DEV) + 0.5
            pos = selector_mod.select(scores, norms, lo, hi, Kc, 1, cfg, fused=False)
            c = torch.clamp(hi - lo, max=Kc)
        for m in mems:
            m.store(0, rpi, pos, c, hi, st["k_cache"], st["v_cache"], st["req_to_token"], seq_lens=n_sel)
        args = (s0["q"], st["k_cache"], st["v_cache"], st["req_to_token"], rpi, lens, D ** -0.5)
        ref = mems[0].attend_fast(0, *args)
        out = torch.full_like(s0["q"], float("nan"))
        mems[1].attend_fast(0, *args, out=out)
        e = rel_err(out, ref) if torch.isfinite(out).all() else float("nan")
        ok &= check(f"memory kernel vs reference fast N={N} B={B} all_selected={full}", e, 1e-2)
        if full:
            ro, _ = K.ref_dense_decode_with_scores(*args)
            ok &= check(f"memory fast == dense (all selected) N={N} B={B}", rel_err(out, ro), 1e-2)
        o1, s1, _ = mems[0].attend_slow(0, *args, max_len=N)
        o2, s2, _ = mems[1].attend_slow(0, *args, max_len=N)
        ok &= check(f"memory slow kernel vs reference N={N} B={B} out", rel_err(o2, o1), 1e-2)
        ok &= check(f"memory slow kernel vs reference N={N} B={B} scores",
                    rel_err(s2[torch.isfinite(s1)], s1[torch.isfinite(s1)]), 1e-3)
        del st, mems
    # fused Selector vs torch on real dense-kernel scores
    N, B = (32768, 2) if not SMOKE else (400, 2)
    st = build_state(B, Hkv, G, D, N, torch.bfloat16, 1, 16, W, contiguous=False, seed=3)
    s0 = st["sets"][0]
    sc = torch.empty(B, Hkv * G, N, device=DEV)
    K.dense_decode_with_scores(s0["q"], st["k_cache"], st["v_cache"], st["req_to_token"],
                               s0["req_pool_indices"], s0["seq_lens"], D ** -0.5, scores_out=sc)
    norms = torch.linalg.vector_norm(st["k_cache"].float(), dim=-1)[
        st["req_to_token"][s0["req_pool_indices"]].long()].permute(0, 2, 1)
    cfg = cfg_mod.SFIConfig(sinks=S, window=W, budget=Kc)
    lo, hi = selector_mod.candidate_range(s0["seq_lens"], S, W)
    for ov in ({}, {"fusion": "geometric"}):
        c2 = cfg.replace(**ov)
        logits = sc.view(B, Hkv, G, N)
        score = selector_mod.select_scores(logits, norms, lo, hi, 1, c2)
        key = selector_mod.select_key_fused(logits, norms, lo, hi, 1, c2)
        fin = torch.isfinite(score)
        same_mask = torch.equal(fin, torch.isfinite(key) & (key > torch.finfo(torch.float32).min))
        e = ((key[fin] - score[fin]).abs() / score[fin].abs().clamp_min(1)).max().item()
        ok &= check(f"fused selector score N={N} B={B} {ov} (max rel)", e if same_mask else float("nan"), 1e-3)
        a = selector_mod.select(logits, norms, lo, hi, Kc, 1, c2, fused=False)
        b = selector_mod.select(logits, norms, lo, hi, Kc, 1, c2, fused=True)
        ok &= check(f"fused selector positions N={N} B={B} {ov} (1 - agreement)",
                    1.0 - (a == b).float().mean().item(), 0.02)
    del st, sc
    if not SMOKE:
        torch.cuda.empty_cache()
    ok &= correctness_topk(selector_mod)
    return ok


def stable_topk_ref(key, k):
    """Documented rule of kernels/topk.py: k largest, ties to the lowest positions, -inf
    dropped, ascending, -1 padded (stable descending sort; test keys have no +-0.0)."""
    B, H, N = key.shape
    kk = min(k, N)
    srt = torch.sort(key.reshape(B * H, N), dim=-1, descending=True, stable=True)
    val, idx = srt.values[:, :kk], srt.indices[:, :kk]
    big = torch.iinfo(torch.int64).max
    idx = torch.where(val > float("-inf"), idx, torch.full_like(idx, big)).sort(-1).values
    idx = torch.where(idx == big, torch.full_like(idx, -1), idx)
    if kk < k:
        idx = F.pad(idx, (0, k - kk), value=-1)
    return idx.reshape(B, H, k)


def correctness_topk(selector_mod):
    """Radix top-k (kernels/topk.py) vs the stable float reference and vs the old torch path
    (torch.topk + sort), on random keys with ties, -inf and float32-lowest entries."""
    log("== radix top-k correctness")
    ok = True
    lowest = torch.finfo(torch.float32).min
    shapes = ((1, 8, 8192, 2048), (8, 8, 32768, 2048), (8, 8, 131072, 2048), (2, 8, 1500, 2048),
              (3, 5, 5000, 333), (4, 8, 131072, 2048)) if not SMOKE else ((1, 2, 600, 48), (2, 2, 40, 48))
    for i, (B, H, N, k) in enumerate(shapes):
        torch.manual_seed(100 + i)
        key = torch.randn(B, H, N, device=DEV) * 4 - 10
        if i % 2 == 1:      # heavy ties: values on a coarse grid (never +-0.0)
            key = torch.round(key * 2) / 2 + 0.125
        key[..., :4] = float("-inf")
        key[..., -256:] = float("-inf")
        key[0, 0, 100:400] = lowest
        if H > 1 and N >= 2000:          # a row with fewer finite keys than k
            key[0, 1] = float("-inf")
            key[0, 1, 50:80] = torch.randn(30, device=DEV)
            key[0, 1, 90:2000] = lowest
        for uh in ((True, False) if i == 0 else (None,)):
            out = torch.full((B, H, k), -7, dtype=torch.int64, device=DEV)
            out.copy_(K.topk_positions(key, k, use_hist=uh))
            ref = stable_topk_ref(key, k)
            ok &= check(f"topk radix vs stable ref B={B} H={H} N={N} k={k} ties={i % 2} hist={uh}",
                        0.0 if torch.equal(out, ref) else 1.0, 0.5)
        if selector_mod is not None:
            old = selector_mod._top_k_from_key_torch(key, k)
            agree = (old == out).float().mean().item()
            ok &= check(f"topk radix vs torch.topk path B={B} H={H} N={N} k={k} ties={i % 2} "
                        f"(1 - agreement)", 1.0 - agree, 1e-9)
    return ok


# ----------------------------------------------------------------------------- timing
def hbm_copy():
    log("== HBM copy bandwidth")
    x = torch.randn(1 << 30, device=DEV, dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    t = bench_do(lambda: y.copy_(x))
    bw = 2 * x.numel() * 2 / (t * 1e-3) / 1e9
    RESULTS["hbm_copy"] = {"bytes_each_way": x.numel() * 2, "ms": t, "GBps_read_plus_write": bw}
    log(f"  copy 2 GiB: {t:.3f} ms -> {bw:.0f} GB/s (read+write)")
    del x, y
    torch.cuda.empty_cache()
    return bw


def run_config(N, B, selector_mod, cfg_mod, l2_bytes, sweep=False, memory_mod=None):
    Hkv, G, D, S, W, Kc = (DIMS[k] for k in ("Hkv", "G", "D", "S", "W", "Kc"))
    Hq, P = Hkv * G, S + Kc
    elt = 2
    cfg = {"N": N, "B": B}
    log(f"== timing N={N} B={B}")
    dense_bytes = B * N * Hkv * D * 2 * elt
    fast_bytes = B * Hkv * (P + W) * D * 2 * elt + B * W * 4 + 2 * B * Hq * D * elt
    pack_bytes = 2 * B * Hkv * P * D * 2 * elt  # read + write, K and V
    scores_bytes = B * Hq * N * 4
    n_dense = max(1, min(8, math.ceil(4 * l2_bytes / dense_bytes)))
    n_fast = max(1, min(32, math.ceil(4 * l2_bytes / fast_bytes)))
    n_sets = max(n_dense, n_fast)
    # KV pool sized for the dense rotation; extra (fast-only) sets reuse KV slots mod n_dense
    st = build_state(B, Hkv, G, D, N, torch.bfloat16, n_dense, P, W, seed=N + B)
    if n_sets > n_dense:
        R = n_sets * B
        st["req_to_token"] = st["req_to_token"].repeat(math.ceil(n_sets / n_dense), 1)[:R].contiguous()
        st["packed_k"] = torch.randn(R, Hkv, P, D, device=DEV, dtype=torch.bfloat16)
        st["packed_v"] = torch.randn(R, Hkv, P, D, device=DEV, dtype=torch.bfloat16)
        st["packed_len"] = torch.full((R,), P, device=DEV, dtype=torch.int32)
        for r in range(n_dense, n_sets):
            s0 = st["sets"][r % n_dense]
            st["sets"].append(dict(s0, q=torch.randn_like(s0["q"]), out=torch.empty_like(s0["out"]),
                                   req_pool_indices=torch.arange(r * B, (r + 1) * B, device=DEV)))
    sets = st["sets"]
    dsets = sets[:n_dense]
    scale = D ** -0.5
    kv = (st["k_cache"], st["v_cache"], st["req_to_token"])
    # --- dense SDPA baseline on contiguous [B,H_kv,N,D]
    sd = []
    for s in dsets:
        idx = st["req_to_token"][s["req_pool_indices"]].long()
        sd.append((s["q"][:, :, None], st["k_cache"][idx].permute(0, 2, 1, 3).contiguous(),
                   st["v_cache"][idx].permute(0, 2, 1, 3).contiguous()))
    res = {}
    summ_extra = {}
    res["sdpa"] = timed("dense_sdpa", cfg, [
        (lambda a=a: F.scaled_dot_product_attention(a[0], a[1], a[2], enable_gqa=True, scale=scale))
        for a in sd], dense_bytes)
    del sd
    torch.cuda.empty_cache()
    # --- our dense kernel, without and with scores
    res["dense"] = timed("dense_triton", cfg, [
        (lambda s=s: K.dense_decode(s["q"], *kv, s["req_pool_indices"], s["seq_lens"], scale,
                                    out=s["out"], max_len=N)) for s in dsets], dense_bytes)
    scores = [torch.empty(B, Hq, N, device=DEV, dtype=torch.float32) for _ in dsets]
    res["dense_scores"] = timed("dense+scores_triton", cfg, [
        (lambda s=s, sc=sc: K.dense_decode_with_scores(s["q"], *kv, s["req_pool_indices"],
                                                       s["seq_lens"], scale, scores_out=sc, out=s["out"]))
        for s, sc in zip(dsets, scores)], dense_bytes + scores_bytes)
    # --- fast kernel
    fk = (st["packed_k"], st["packed_v"], st["packed_len"])
    res["fast"] = timed("fast_triton", cfg, [
        (lambda s=s: K.fast_decode(s["q"], *kv, s["req_pool_indices"], s["seq_lens"], s["win_start"],
                                   *fk, scale, out=s["out"])) for s in sets], fast_bytes)
    if sweep:
        for bn in ((32,) if SMOKE else (32, 64, 128)):
            for ns in ((1, 2) if SMOKE else (1, 2, 4, 8, 16, 32)):
                for nw in ((4,) if SMOKE else (4, 8)):
                    timed(f"fast_sweep_bn{bn}_s{ns}_w{nw}", dict(cfg, block_n=bn, splits=ns, warps=nw), [
                        (lambda s=s: K.fast_decode(s["q"], *kv, s["req_pool_indices"], s["seq_lens"],
                                                   s["win_start"], *fk, scale, out=s["out"],
                                                   num_splits=ns, block_n=bn, num_warps=nw))
                        for s in sets], fast_bytes)
        for bn in ((32,) if SMOKE else (64, 128)):
            for nw in ((4,) if SMOKE else (4, 8)):
                timed(f"dense_sweep_bn{bn}_w{nw}", dict(cfg, block_n=bn, warps=nw), [
                    (lambda s=s, sc=sc: K.dense_decode_with_scores(
                        s["q"], *kv, s["req_pool_indices"], s["seq_lens"], scale, scores_out=sc,
                        out=s["out"], block_n=bn, num_warps=nw)) for s, sc in zip(dsets, scores)],
                    dense_bytes + scores_bytes)
    # --- pack (one layer's slow-step re-pack)
    pos = [random_positions(B, Hkv, N, S, Kc, W) for _ in sets]
    res["pack"] = timed("pack_triton", cfg, [
        (lambda s=s, p=p: K.pack(*kv, s["req_pool_indices"], p, st["packed_k"], st["packed_v"]))
        for s, p in zip(sets, pos)], pack_bytes)
    # --- Selector (torch) on the slow step's scores of one layer
    if selector_mod is not None:
        sfi_cfg = cfg_mod.SFIConfig(sinks=S, window=W, budget=Kc)
        s0, sc0 = dsets[0], scores[0]
        nm0 = torch.empty(B, Hkv, N, device=DEV, dtype=torch.bfloat16)  # the slow pass's key norms
        K.dense_decode_with_scores(s0["q"], *kv, s0["req_pool_indices"], s0["seq_lens"], scale,
                                   scores_out=sc0, out=s0["out"], norms_out=nm0)

        def run_selector(s=s0, sc=sc0, fused=False):
            lo, hi = selector_mod.candidate_range(s["seq_lens"], S, W)
            return selector_mod.select(sc.view(B, Hkv, G, N), nm0, lo, hi, Kc, 1, sfi_cfg,
                                       fused=fused)

        for fused, name in ((True, "selector"), (False, "selector_torch")):
            try:
                sel = run_selector(fused=fused)
                assert sel.shape == (B, Hkv, Kc)
                if fused:
                    ref_sel = run_selector(fused=False)
                    agree = (sel == ref_sel).float().mean().item()
                    check(f"selector fused vs torch positions N={N} B={B} (1 - agreement)",
                          1.0 - agree, 0.02)
                # both no-host-sync now: CUDA-graph replay (GPU time), and do_bench (eager)
                r = timed("selector_fused" if fused else "selector_torch", cfg,
                          [lambda f=fused: run_selector(fused=f)], graph=True)
                res[name] = r
                summ_extra[name + "_eager_ms"] = r.get("do_bench_ms")
            except Exception:
                RESULTS["errors"].append(f"{name} N={N} B={B}: {traceback.format_exc()[-1500:]}")
                log("  selector failed:", traceback.format_exc()[-600:])
        # --- Selector breakdown: the four fused launches (cumulative),
        # top-k alone (radix Triton vs the old torch.topk + sort), on this layer's key
        try:
            lo0, hi0 = selector_mod.candidate_range(s0["seq_lens"], S, W)
            kn0 = nm0
            lg0 = sc0.view(B, Hkv, G, N)
            lam0 = torch.full((B,), sfi_cfg.lambda_max_single, device=DEV)
            key0 = K.fused_topk_key(lg0, kn0, lo0, hi0, lam0, sfi_cfg)
            a = K.topk_positions(key0, Kc)
            b = selector_mod._top_k_from_key_torch(key0, Kc)
            check(f"topk radix vs torch on the Selector key N={N} B={B}", 0.0 if torch.equal(a, b) else 1.0, 0.5)
            for upto in (1, 2, 3, 4):
                r = timed(f"sel_key_upto{upto}", cfg, [lambda u=upto: K.fused_topk_key(lg0, kn0, lo0, hi0, lam0, sfi_cfg, upto=u)])
                summ_extra[f"sel_key_upto{upto}_ms"] = r.get("ms")
            r = timed("topk_radix", cfg, [lambda: K.topk_positions(key0, Kc)])
            summ_extra["topk_radix_ms"] = r.get("ms")
            r = timed("topk_torch", cfg, [lambda: selector_mod._top_k_from_key_torch(key0, Kc)])
            summ_extra["topk_torch_ms"] = r.get("ms")
            r = timed("topk_radix_onehot", cfg, [lambda: K.topk_positions(key0, Kc, use_hist=False)])
            summ_extra["topk_radix_onehot_ms"] = r.get("ms")
            del key0, kn0
        except Exception:
            RESULTS["errors"].append(f"selector breakdown N={N} B={B}: {traceback.format_exc()[-1500:]}")
            log("  breakdown failed:", traceback.format_exc()[-600:])
        if N == 32768 and B == 8 and not SMOKE:
            # batched over 4 layers (one call, B' = 4 * B): per-layer cost when the slow
            # step's selections of several layers run together
            try:
                L4 = 4
                sc4 = sc0.view(1, B, Hkv, G, N).expand(L4, -1, -1, -1, -1).reshape(L4 * B, Hkv, G, N)
                lo4, hi4 = selector_mod.candidate_range(s0["seq_lens"].repeat(L4), S, W)
                kn4 = nm0.repeat(L4, 1, 1)
                r = timed("selector_fused_4layers", cfg, [lambda: selector_mod.select(
                    sc4, kn4, lo4, hi4, Kc, 1, sfi_cfg, fused=True)], graph=True)
                summ_extra["selector_fused_per_layer_batched4_ms"] = r.get("ms", float("nan")) / L4
                del sc4, kn4
            except Exception:
                RESULTS["errors"].append(f"selector 4 layers: {traceback.format_exc()[-1500:]}")
    # --- SparseMemory.attend_fast (the backend's fast-step entry point) on the same state
    if memory_mod is not None:
        try:
            R_ = st["packed_k"].shape[0]
            mem = memory_mod.SparseMemory(1, [0], 1, Hkv, D, cfg_mod.SFIConfig(
                sinks=S, window=W, budget=Kc, dense_layers=()), DEV, torch.bfloat16, packed=True)
            # share the benchmark's buffers (R_ pool slots) instead of allocating new ones
            mem.packed_k[0], mem.packed_v[0] = st["packed_k"], st["packed_v"]
            mem.packed_len = st["packed_len"]
            mem.win_start = torch.full((R_,), N - W, dtype=torch.int64, device=DEV)
            mem.n_sinks = torch.full((R_,), S, dtype=torch.int32, device=DEV)
            mem.fast_ws = torch.full((R_,), N - W, dtype=torch.int64, device=DEV)
            res["mem_fast"] = timed("memory_attend_fast", cfg, [
                (lambda s=s: mem.attend_fast(0, s["q"], *kv, s["req_pool_indices"], s["seq_lens"],
                                             scale, out=s["out"])) for s in sets], fast_bytes)
            del mem
        except Exception:
            RESULTS["errors"].append(f"memory N={N} B={B}: {traceback.format_exc()[-1500:]}")
            log("  memory failed:", traceback.format_exc()[-600:])
    del st, scores, pos
    torch.cuda.empty_cache()
    summ = {"N": N, "B": B, "dense_bytes": dense_bytes, "fast_bytes": fast_bytes,
            "pack_bytes": pack_bytes, "scores_bytes": scores_bytes, "rot_sets_dense": n_dense,
            "rot_sets_fast": n_sets}
    for k_, r in res.items():
        summ[k_ + "_ms"] = r.get("ms")
    summ.update(summ_extra)
    if summ.get("sdpa_ms") and summ.get("fast_ms"):
        summ["speedup_fast_vs_sdpa"] = summ["sdpa_ms"] / summ["fast_ms"]
        summ["speedup_fast_vs_dense_triton"] = summ["dense_ms"] / summ["fast_ms"]
        summ["fast_GBps"] = fast_bytes / (summ["fast_ms"] * 1e-3) / 1e9
    if summ.get("dense_scores_ms"):
        # slow step = dense+scores + fused Selector (graph) + pack, per layer
        slow = summ["dense_scores_ms"] + (summ.get("pack_ms") or 0) + (summ.get("selector_ms") or 0)
        summ["slow_step_ms"] = slow
        summ["slow_step_has_selector"] = "selector_ms" in summ and summ["selector_ms"] is not None
        if summ.get("sdpa_ms"):
            summ["slow_over_sdpa"] = slow / summ["sdpa_ms"]
            if summ.get("selector_torch_ms"):
                summ["slow_over_sdpa_torch_selector"] = (
                    summ["dense_scores_ms"] + (summ.get("pack_ms") or 0) + summ["selector_torch_ms"]) / summ["sdpa_ms"]
        summ["slow_over_dense_triton"] = slow / summ["dense_ms"]
    RESULTS.setdefault("summary", []).append(summ)
    return summ


def profile_selector(selector_mod, cfg_mod, out_dir):
    """Selector inputs at 8K B=1 and 128K B=8: key-norm gather variants (advanced indexing as
    in the backend vs index_select), evid_prior on strided vs contiguous norms, radix top-k
    grid/block variants."""
    Hkv, G, D, S, W, Kc = (DIMS[k] for k in ("Hkv", "G", "D", "S", "W", "Kc"))
    sfi_cfg = cfg_mod.SFIConfig(sinks=S, window=W, budget=Kc)
    for N, B in ((8192, 1), (131072, 8)):
        cfg = {"N": N, "B": B}
        log(f"== profile N={N} B={B}")
        slots = B * N
        pool = torch.rand(slots, Hkv, device=DEV) + 0.5
        rtt = torch.arange(slots, device=DEV, dtype=torch.int32).view(B, N)
        rpi = torch.arange(B, device=DEV)
        logits = torch.randn(B, Hkv, G, N, device=DEV) * 3
        lo, hi = selector_mod.candidate_range(torch.full((B,), N, device=DEV), S, W)
        lam = torch.full((B,), sfi_cfg.lambda_max_single, device=DEV)
        timed("gather_adv_index", cfg, [lambda: pool[rtt[rpi].long()].permute(0, 2, 1)])
        timed("gather_index_select", cfg, [lambda: pool.index_select(0, rtt[rpi].reshape(-1)).view(B, N, Hkv).permute(0, 2, 1)])
        timed("gather_index_select_contig", cfg, [lambda: pool.index_select(0, rtt[rpi].reshape(-1)).view(B, N, Hkv).permute(0, 2, 1).contiguous()])
        kn_s = pool[rtt[rpi].long()].permute(0, 2, 1)
        kn_c = kn_s.contiguous()
        for nm, kn in (("strided", kn_s), ("contig", kn_c)):
            for u in (1, 2, 4):
                timed(f"sel_key_upto{u}_{nm}_norms", cfg, [lambda kn=kn, u=u: K.fused_topk_key(logits, kn, lo, hi, lam, sfi_cfg, upto=u)])
        key = K.fused_topk_key(logits, kn_c, lo, hi, lam, sfi_cfg)
        ref = selector_mod._top_k_from_key_torch(key, Kc)
        for blk, nw in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (512, 4)):
            o = K.topk_positions(key, Kc, block=blk, num_warps=nw)
            check(f"topk variant block={blk} warps={nw} N={N} B={B}", 0.0 if torch.equal(o, ref) else 1.0, 0.5)
            timed(f"topk_b{blk}_w{nw}", cfg, [lambda blk=blk, nw=nw: K.topk_positions(key, Kc, block=blk, num_warps=nw)])
        timed("topk_torch", cfg, [lambda: selector_mod._top_k_from_key_torch(key, Kc)])
        del pool, logits, kn_s, kn_c, key
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "kernels_h200_profile.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    for t in RESULTS["timings"]:
        log(f"{t['op']:36s} N={t['N']:>6} B={t['B']} {t.get('ms', float('nan')) * 1e3:8.1f} us")


@triton.jit
def _null_kernel(X):
    pass


@triton.jit
def _stream_kernel(X, Out, n_per, BLOCK: tl.constexpr):
    """Each program sums its contiguous share of X (bf16): a pure read of the bytes."""
    pid = tl.program_id(0)
    base = X + pid.to(tl.int64) * n_per
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n_per, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(base + offs, mask=offs < n_per, other=0.0).to(tl.float32)
    tl.store(Out + pid, tl.sum(acc, 0))


def floor(l2_bytes):
    """What bounds the fast step at batch 1: the cost of one launch in a
    CUDA graph, the best one-launch read of the fast step's bytes (a streaming kernel over
    the same bytes at several grid sizes), and fast-kernel variants with more parallelism
    than the tune phase tried (more splits, 32-token tiles), at B=1 and B=8, 32K."""
    Hkv, G, D, S, W, Kc = (DIMS[k] for k in ("Hkv", "G", "D", "S", "W", "Kc"))
    Hq, P = Hkv * G, S + Kc
    x = torch.zeros(1, device=DEV)
    timed("floor_null_launch", {"grid": Hkv * 16}, [lambda: _null_kernel[(1, Hkv, 16)](x)])
    for B in (1, 8):
        fast_bytes = B * Hkv * (P + W) * D * 2 * 2 + B * W * 4 + 2 * B * Hq * D * 2
        n_sets = max(1, min(32, math.ceil(4 * l2_bytes / fast_bytes)))
        bufs = [torch.randn(fast_bytes // 2, device=DEV, dtype=torch.bfloat16) for _ in range(n_sets)]
        for grid in (132, 264, 528, 1056, 2112):
            n_per = triton.cdiv(bufs[0].numel(), grid)
            outs = torch.empty(grid, device=DEV)
            for blk in (1024, 4096):
                timed(f"floor_stream_g{grid}_b{blk}", {"B": B, "grid": grid, "block": blk}, [
                    (lambda b=b, n_per=n_per, grid=grid, outs=outs, blk=blk:
                     _stream_kernel[(grid,)](b, outs, n_per, BLOCK=blk, num_warps=8))
                    for b in bufs], fast_bytes)
        del bufs
        N = 32768 if not SMOKE else 256
        st = build_state(B, Hkv, G, D, N, torch.bfloat16, n_sets, P, W, seed=B)
        kv = (st["k_cache"], st["v_cache"], st["req_to_token"])
        fk = (st["packed_k"], st["packed_v"], st["packed_len"])
        scale = D ** -0.5
        cfg = {"N": N, "B": B}
        variants = [(None, None, None, None)]
        variants += [(bn, ns, nw, stg) for bn in (32, 64) for ns in ((16, 32, 64) if B == 1 else (4, 8, 16))
                     for nw in (2, 4) for stg in (2, 3)]
        for bn, ns, nw, stg in variants:
            name = "floor_fast_default" if bn is None else f"floor_fast_bn{bn}_s{ns}_w{nw}_st{stg}"
            timed(name, dict(cfg, block_n=bn, splits=ns, warps=nw, stages=stg), [
                (lambda s=s_, bn=bn, ns=ns, nw=nw, stg=stg: K.fast_decode(
                    s["q"], *kv, s["req_pool_indices"], s["seq_lens"], s["win_start"], *fk, scale,
                    out=s["out"], num_splits=ns, block_n=bn, num_warps=nw, num_stages=stg))
                for s_ in st["sets"]], fast_bytes)
        del st
        torch.cuda.empty_cache()


def fast_state(B, N, l2_bytes):
    """The fast kernel's inputs at B requests of N tokens (Qwen3-4B's layer, bf16): its bytes
    per call, and enough rotation sets that L2 holds none of the next call's (bytes, state,
    (K, V, req_to_token), (packed K, packed V, packed length))."""
    Hkv, G, D, S, W, Kc = (DIMS[k] for k in ("Hkv", "G", "D", "S", "W", "Kc"))
    Hq, P = Hkv * G, S + Kc
    fast_bytes = B * Hkv * (P + W) * D * 2 * 2 + B * W * 4 + 2 * B * Hq * D * 2
    n_sets = max(1, min(32, math.ceil(4 * l2_bytes / fast_bytes)))
    st = build_state(B, Hkv, G, D, N, torch.bfloat16, n_sets, P, W, seed=B)
    return (fast_bytes, st, (st["k_cache"], st["v_cache"], st["req_to_token"]),
            (st["packed_k"], st["packed_v"], st["packed_len"]))


def holes(l2_bytes):
    """The packed fast kernel with the hole check (`holes=sel_pos`, whole pages) against
    the default one, at 32K, B=1 and B=8: what switching the check on for every server
    would cost (it would let a request's page size differ from the server's on a GPU)."""
    Hkv, D, S, W, Kc = (DIMS[k] for k in ("Hkv", "D", "S", "W", "Kc"))
    N = 32768 if not SMOKE else 256
    for B in (1, 8):
        fast_bytes, st, kv, fk = fast_state(B, N, l2_bytes)
        R = len(st["sets"]) * B
        # every head full (no hole), and one page of 16 in eight missing (an edge page)
        full = random_positions(R, Hkv, N, S, Kc, W)[:, :, S:].contiguous()
        holed = full.clone()
        holed.view(R, Hkv, -1, 16)[:, :, ::8] = -1
        scale = D ** -0.5
        for name, h in (("holes_off", None), ("holes_on_full", full), ("holes_on_eighth", holed)):
            timed(name, {"N": N, "B": B}, [
                (lambda s=s_, h=h: K.fast_decode(
                    s["q"], *kv, s["req_pool_indices"], s["seq_lens"], s["win_start"], *fk, scale,
                    out=s["out"], holes=h, hole_base=S if h is not None else 0))
                for s_ in st["sets"]], fast_bytes)
        del st, kv, fk
        torch.cuda.empty_cache()


def tune(l2_bytes):
    """Sweeps for choosing kernel defaults: fast kernel (block, splits, warps, stages,
    fused reduce) at B=1 and B=8; dense+scores kernel at 128K B=8."""
    Hkv, G, D, W = (DIMS[k] for k in ("Hkv", "G", "D", "W"))
    Hq = Hkv * G
    scale = D ** -0.5
    N = 8192 if not SMOKE else 256
    for B in (8, 1):
        fast_bytes, st, kv, fk = fast_state(B, N, l2_bytes)
        cfg = {"N": N, "B": B}
        log(f"== fast sweep B={B} (rotation sets {len(st['sets'])})")
        splits_set = (4, 8, 16) if B == 8 else (8, 16, 32)
        variants = [(bn, ns, nw, stg, True) for bn in (64, 128) for ns in splits_set
                    for nw in (4, 8) for stg in (2, 3, 4)]
        variants += [(128, 8, 4, 2, False), (128, 8, 4, 3, False), (64, 16, 4, 2, False),
                     (128, 32, 4, 2, False), (64, 8, 8, 3, False), (None, None, None, None, None)]
        if SMOKE:
            variants = [(32, 2, 4, 2, True), (32, 2, 4, 2, False), (None, None, None, None, None)]
        for bn, ns, nw, stg, fu in variants:
            timed(f"tune_fast_bn{bn}_s{ns}_w{nw}_st{stg}_f{int(bool(fu))}" if bn else "tune_fast_default",
                  dict(cfg, block_n=bn, splits=ns, warps=nw, stages=stg, fused=fu), [
                      (lambda s=s, bn=bn, ns=ns, nw=nw, stg=stg, fu=fu: K.fast_decode(
                          s["q"], *kv, s["req_pool_indices"], s["seq_lens"], s["win_start"], *fk, scale,
                          out=s["out"], num_splits=ns, block_n=bn, num_warps=nw, num_stages=stg,
                          fused_reduce=fu)) for s in st["sets"]], fast_bytes)
        del st, kv, fk
        torch.cuda.empty_cache()
    N, B = (131072, 8) if not SMOKE else (512, 2)
    dense_bytes = B * N * Hkv * D * 2 * 2
    st = build_state(B, Hkv, G, D, N, torch.bfloat16, 1, 16, W, seed=7)
    kv = (st["k_cache"], st["v_cache"], st["req_to_token"])
    s0 = st["sets"][0]
    sc = torch.empty(B, Hq, N, device=DEV, dtype=torch.float32)
    cfg = {"N": N, "B": B}
    log(f"== dense sweep N={N} B={B}")
    variants = [(bn, nw, stg, ns) for bn in (32, 64, 128) for nw in (4, 8) for stg in (2, 3, 4)
                for ns in (None,)] + [(64, 4, 2, 16), (64, 4, 3, 16), (64, 4, 2, 2 * 132 // 64 * 2)]
    if SMOKE:
        variants = [(32, 4, 2, None)]
    for bn, nw, stg, ns in variants:
        for scores in (True, False):
            if not scores and not (bn == 64 and nw == 4):
                continue
            if scores:
                fn = (lambda bn=bn, nw=nw, stg=stg, ns=ns: K.dense_decode_with_scores(
                    s0["q"], *kv, s0["req_pool_indices"], s0["seq_lens"], scale, scores_out=sc,
                    out=s0["out"], block_n=bn, num_warps=nw, num_stages=stg, num_splits=ns))
            else:
                fn = (lambda bn=bn, nw=nw, stg=stg, ns=ns: K.dense_decode(
                    s0["q"], *kv, s0["req_pool_indices"], s0["seq_lens"], scale, out=s0["out"],
                    max_len=N, block_n=bn, num_warps=nw, num_stages=stg, num_splits=ns))
            timed(f"tune_dense{'_scores' if scores else ''}_bn{bn}_w{nw}_st{stg}_s{ns}",
                  dict(cfg, block_n=bn, warps=nw, stages=stg, splits=ns, scores=scores), [fn],
                  dense_bytes + (B * Hq * N * 4 if scores else 0))
    del st, kv, sc
    torch.cuda.empty_cache()


def plot(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = RESULTS.get("summary", [])
    if not summ:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    labels = [f"N={s['N'] // 1024}K\nB={s['B']}" for s in summ]
    ops = [("sdpa_ms", "dense SDPA"), ("dense_ms", "dense Triton"), ("dense_scores_ms", "dense+scores"),
           ("selector_torch_ms", "Selector (torch, graph)"), ("selector_ms", "Selector (fused, graph)"),
           ("pack_ms", "pack"), ("fast_ms", "fast (SFI)")]
    w = 0.8 / len(ops)
    for i, (k_, name) in enumerate(ops):
        xs = [j + i * w for j in range(len(summ))]
        ys = [s.get(k_) or 0 for s in summ]
        axes[0].bar(xs, ys, w, label=name)
    axes[0].set_yscale("log")
    axes[0].set_xticks([j + 0.4 - w / 2 for j in range(len(summ))], labels)
    axes[0].set_ylabel("ms per layer (CUDA-graph replay, median)")
    axes[0].set_title("H200, Qwen3-4B heads (32/8/128, bf16), P=2052 + W=256")
    axes[0].legend(fontsize=8)
    for j, s in enumerate(summ):
        if s.get("speedup_fast_vs_sdpa"):
            axes[0].annotate(f"{s['speedup_fast_vs_sdpa']:.1f}x", (j + 6 * w, s["fast_ms"]),
                             ha="center", va="bottom", fontsize=8)
    hbm = RESULTS.get("hbm_copy", {}).get("GBps_read_plus_write")
    bw = [s.get("fast_GBps") or 0 for s in summ]
    dbw = [(s["dense_bytes"] / (s["sdpa_ms"] * 1e-3) / 1e9) if s.get("sdpa_ms") else 0 for s in summ]
    axes[1].bar([j - 0.2 for j in range(len(summ))], bw, 0.4, label="fast kernel")
    axes[1].bar([j + 0.2 for j in range(len(summ))], dbw, 0.4, label="dense SDPA")
    if hbm:
        axes[1].axhline(hbm, color="k", ls="--", label=f"HBM copy {hbm:.0f} GB/s")
        axes[1].axhline(0.7 * hbm, color="r", ls=":", label="70% of copy")
    axes[1].set_xticks(range(len(summ)), labels)
    axes[1].set_ylabel("GB/s (bytes that must be read / time)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save_results(out_dir, name, t0):
    """RESULTS, with the wall time since t0, as out_dir/name."""
    RESULTS["wall_s"] = time.time() - t0
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(RESULTS, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--phase", choices=("full", "tune", "profile", "floor", "holes"), default="full")
    ap.add_argument("--sweep", action="store_true", help="full phase: also the old fast/dense sweep at 8K")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    if SMOKE:
        l2 = 1 << 16
        RESULTS["env"] = {"device": "cpu-smoke"}
    else:
        props = torch.cuda.get_device_properties(0)
        l2 = getattr(props, "L2_cache_size", 60 * 2**20)
        RESULTS["env"] = {"device": props.name, "sms": props.multi_processor_count, "l2_bytes": l2,
                          "torch": torch.__version__, "triton": triton.__version__}
    log(json.dumps(RESULTS["env"]))
    try:
        selector_mod, cfg_mod = load_selector()
    except Exception:
        selector_mod = cfg_mod = None
        RESULTS["errors"].append("selector import: " + traceback.format_exc()[-1000:])
        log("selector import failed")
    try:
        memory_mod = load_memory()
    except Exception:
        memory_mod = None
        RESULTS["errors"].append("memory import: " + traceback.format_exc()[-1000:])
        log("memory import failed")
    if args.phase == "profile":
        profile_selector(selector_mod, cfg_mod, args.out)
        return
    if args.phase == "holes":  # the packed kernel's hole check, on and off
        holes(l2)
        save_results(args.out, "kernels_h200_holes.json", t0)
        for t in RESULTS["timings"]:
            log(f"B={t['B']} {t['op']:20s} {t.get('ms', float('nan')) * 1e3:7.2f} us")
        for e in RESULTS["errors"]:
            log("ERROR:", e[-400:])
        return
    if args.phase == "floor":  # what bounds the fast step at batch 1
        if not SMOKE:
            hbm_copy()
        floor(l2)
        save_results(args.out, "kernels_h200_floor.json", t0)
        for B in (1, 8):
            c = sorted((t for t in RESULTS["timings"] if t.get("B") == B and "ms" in t), key=lambda t: t["ms"])
            for t in c[:6] + [t for t in c if t["op"] == "floor_fast_default"]:
                log(f"B={B} {t['op']:36s} {t['ms'] * 1e3:7.2f} us {t.get('GBps', 0):6.0f} GB/s")
        for e in RESULTS["errors"]:
            log("ERROR:", e[-400:])
        return
    hbm = hbm_copy() if not SMOKE else 1.0
    ok = True
    try:
        ok &= correctness_memory_selector(memory_mod, selector_mod, cfg_mod)
    except Exception:
        RESULTS["errors"].append(f"correctness_memory_selector: {traceback.format_exc()[-1500:]}")
        log(traceback.format_exc()[-1500:])
        ok = False
    ok &= correctness()
    for N, B in (((32768, 8), (131072, 2)) if not SMOKE else ((300, 3),)):
        try:
            ok &= correctness_real(N, B)
        except Exception:
            RESULTS["errors"].append(f"correctness_real {N} {B}: {traceback.format_exc()[-1500:]}")
            ok = False
    RESULTS["all_checks_ok"] = bool(ok)
    log(f"correctness all ok: {ok}  ({time.time() - t0:.0f}s)")
    if args.phase == "tune":
        try:
            tune(l2)
        except Exception:
            RESULTS["errors"].append(f"tune: {traceback.format_exc()[-1500:]}")
            log(traceback.format_exc()[-1500:])
        save_results(args.out, "kernels_h200_tune.json", t0)
        for e in RESULTS["errors"]:
            log("ERROR:", e[-400:])
        tt = [t for t in RESULTS["timings"] if "ms" in t]
        for B in (8, 1):
            c = sorted((t for t in tt if t["op"].startswith("tune_fast") and t["B"] == B),
                       key=lambda t: t["ms"])
            log(f"fast B={B} best 8 of {len(c)}:")
            for t in c[:8]:
                log(f"  {t['op']:36s} {t['ms'] * 1e3:6.1f} us {t['GBps']:6.0f} GB/s")
            for t in c:
                if t["op"] == "tune_fast_default":
                    log(f"  {t['op']:36s} {t['ms'] * 1e3:6.1f} us {t['GBps']:6.0f} GB/s")
        c = sorted((t for t in tt if t["op"].startswith("tune_dense")), key=lambda t: t["ms"])
        log("dense 128K B=8:")
        for t in c:
            log(f"  {t['op']:36s} {t['ms'] * 1e3:7.1f} us {t['GBps']:6.0f} GB/s")
        log(f"HBM copy {hbm:.0f} GB/s; checks ok={ok}; wall {time.time() - t0:.0f}s")
        return
    configs = [(8192, 1), (8192, 8), (32768, 1), (32768, 8), (131072, 1), (131072, 8)]
    if args.quick:
        configs = [(8192, 8)]
    if SMOKE:
        configs = [(256, 1), (384, 2)]
    for N, B in configs:
        try:
            run_config(N, B, selector_mod, cfg_mod, l2,
                       sweep=args.sweep and (N == 8192 or (SMOKE and N == 256)), memory_mod=memory_mod)
        except Exception:
            RESULTS["errors"].append(f"config {N} {B}: {traceback.format_exc()[-1500:]}")
            log(traceback.format_exc()[-1500:])
        with open(os.path.join(args.out, "kernels_h200.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
    save_results(args.out, "kernels_h200.json", t0)
    try:
        plot(os.path.join(args.out, "kernels_h200.png"))
    except Exception:
        RESULTS["errors"].append("plot: " + traceback.format_exc()[-800:])
    # best sweep points
    sw = [t for t in RESULTS["timings"] if t["op"].startswith("fast_sweep") and "ms" in t]
    for B in (1, 8):
        c = sorted((t for t in sw if t["B"] == B), key=lambda t: t["ms"])[:3]
        for t in c:
            log(f"best fast B={B}: {t['op']} {t['ms'] * 1e3:.1f} us")
    dsw = sorted((t for t in RESULTS["timings"] if t["op"].startswith("dense_sweep") and "ms" in t),
                 key=lambda t: (t["B"], t["ms"]))
    for t in dsw:
        log(f"dense sweep B={t['B']}: {t['op']} {t['ms'] * 1e3:.1f} us")
    log(f"\nHBM copy {hbm:.0f} GB/s; checks ok={RESULTS['all_checks_ok']}; errors={len(RESULTS['errors'])}")
    for e in RESULTS["errors"]:
        log("ERROR:", e[-400:])
    hdr = f"{'N':>7} {'B':>2} {'sdpa_us':>9} {'dense_us':>9} {'d+sc_us':>9} {'selF_us':>9} {'selT_us':>9} {'pack_us':>8} {'fast_us':>8} {'memf_us':>9} {'x_sdpa':>7} {'fastGB/s':>8} {'slow/sdpa':>9}"
    log(hdr)
    for s in RESULTS.get("summary", []):
        f = lambda k_, m=1e3: f"{s[k_] * m:9.1f}" if s.get(k_) is not None else f"{'-':>9}"
        log(f"{s['N']:>7} {s['B']:>2} {f('sdpa_ms')} {f('dense_ms')} {f('dense_scores_ms')} {f('selector_ms')} {f('selector_torch_ms')}"
            f" {f('pack_ms')} {f('fast_ms')} {f('mem_fast_ms')} {f('speedup_fast_vs_sdpa', 1)} {f('fast_GBps', 1)} {f('slow_over_sdpa', 1)}")
    log(f"{'N':>7} {'B':>2} {'k1':>7} {'k1+2':>7} {'k1-3':>7} {'k1-4':>7} {'topkR':>7} {'topkT':>7} {'topk1h':>7} {'selF':>7}")
    for s in RESULTS.get("summary", []):
        f = lambda k_: f"{s[k_] * 1e3:7.1f}" if s.get(k_) is not None else f"{'-':>7}"
        log(f"{s['N']:>7} {s['B']:>2} {f('sel_key_upto1_ms')} {f('sel_key_upto2_ms')} {f('sel_key_upto3_ms')}"
            f" {f('sel_key_upto4_ms')} {f('topk_radix_ms')} {f('topk_torch_ms')} {f('topk_radix_onehot_ms')} {f('selector_ms')}")
    log(f"wall {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
