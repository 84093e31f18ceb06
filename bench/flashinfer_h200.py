"""FlashInfer fast path (kernels/flashinfer_fast.py) vs the Triton fast kernels, one GPU.

Predictions and outcomes in bench/NOTES.md sections 14 and 41. Needs FlashInfer
importable (bench/flashinfer_h200.sh unpacks a trimmed copy and runs this):
    python3 bench/flashinfer_h200.py --out $OUT

All paths run through SparseMemory (sfi_sglang/method/memory.py), the backend's code:
  triton       store packs sinks + selected; attend_fast = one kernels.fast_decode launch
  triton-pool  the same kernel reading sinks + selected in place (nothing packed)
  flashinfer   nothing packed; plan_fast once per batch size (host), fast_lists once per
               step, attend_fast = the lists (one Triton launch), FlashInfer's decode over
               rows of <= 128 entries, the rows' merge (one Triton launch): no host work
  1. Correctness vs float64 (kernels.reference.ref_fast_decode over the same selection):
     ragged small shapes (G = 1, 4, 8; one with whole pages, KV head 0 holding fewer
     positions than the count; one over an fp8 KV cache) and Qwen3-4B shapes at 32K B=8,
     eagerly and in a CUDA graph replayed after the lengths, window starts and selections
     changed (shorter lists than planned, other counts).
  2. Per-layer times (CUDA-graph replays) at N in {8K, 32K, 128K} x B in {1, 8} (budget
     4 + 2048 + 256): dense SDPA, each fast path, FlashInfer's decode alone.
Writes flashinfer_h200.json, prints a table last.
"""

import argparse
import json
import math
import os
import pathlib
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import kernels_h200 as KH  # noqa: E402  (kernels, timing helpers, RESULTS)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

K, DEV, log, timed, check = KH.K, KH.DEV, KH.log, KH.timed, KH.check
RESULTS = KH.RESULTS
MEM = KH.load_memory()
from sfi_sglang.kernels import flashinfer_fast as FF  # noqa: E402
_, CFG = KH.load_selector()


def memories(S, W, Kc, M, Hkv, D, dtype, G=1, page=1, kv_dtype=None):
    """One memory per fast path; dtype the queries', kv_dtype the KV cache's (fp8)."""
    base = CFG.SFIConfig(sinks=S, window=W, budget=Kc, dense_layers=(), selection_page=page)
    return [MEM.SparseMemory(1, [0], M, Hkv, D, base.replace(fast_path=fp), DEV, kv_dtype or dtype, packed=True,
                             group=G, q_dtype=dtype)
            for fp in ("triton", "triton-pool", "flashinfer")]


def store_random(mems, rpi, seq_lens, S, W, Kc, kc, vc, r2t, holes=False):
    """The same random selection (Kc sorted positions in [S, n - W) per row and head) in
    every memory; holes: KV head 0 of each row holds fewer (trailing -1 entries, as whole
    pages leave them)."""
    H = kc.shape[1]
    B = rpi.numel()
    n = seq_lens.tolist()
    pos = torch.full((B, H, Kc), -1, dtype=torch.int32, device=DEV)
    cnt = torch.zeros(B, dtype=torch.int32, device=DEV)
    for b in range(B):
        hi = n[b] - W
        c = max(0, min(Kc, hi - S))
        if c:
            sel = torch.rand(H, hi - S, device=DEV).topk(c, -1).indices.sort(-1).values + S
            pos[b, :, :c] = sel.int()
            if holes:
                pos[b, 0, c - (b % 3 + 1) * c // 4:c] = -1
        cnt[b] = c
    ws = (seq_lens.long() - W).clamp_min(S)
    for m in mems:
        m.reset(rpi)
        m.store(0, rpi, pos, cnt, ws, kc, vc, r2t, seq_lens=seq_lens)


def correctness():
    ok = True
    ref = KH.K.ref_fast_decode
    fp8 = torch.float8_e4m3fn  # an fp8 KV cache (unit scales) under bf16 queries
    for G, D, dtype, lens, S, W, Kc, page, kv in [(1, 128, torch.bfloat16, [300, 1000, 77], 4, 32, 48, 1, None),
                                                  (4, 128, torch.bfloat16, [513, 90, 2000, 36], 4, 64, 100, 1, None),
                                                  (4, 128, torch.bfloat16, [513, 90, 2000, 36], 4, 64, 100, 4, None),
                                                  (4, 128, torch.bfloat16, [513, 90, 2000, 36], 4, 64, 100, 1, fp8),
                                                  (8, 128, torch.float16, [700, 260], 4, 32, 64, 1, None),
                                                  # 300 rows: the path's buffers hold 256, two chunks
                                                  (4, 128, torch.bfloat16, [600, 90, 1500] * 100, 4, 64, 100, 1,
                                                   None),
                                                  (4, 128, torch.bfloat16, [32768] * 8, 4, 256, 2048, 1, None)]:
        Hkv = 8 if lens[0] == 32768 else 2
        B, M = len(lens), len(lens) + 3
        ntok = sum(lens) + 5
        kc = torch.randn(ntok, Hkv, D, device=DEV, dtype=dtype).to(kv or dtype)
        vc = torch.randn(ntok, Hkv, D, device=DEV, dtype=dtype).to(kv or dtype)
        r2t = torch.zeros(M, max(lens) + 4, dtype=torch.int32, device=DEV)
        rpi = torch.randperm(M, device=DEV)[:B]
        perm = torch.randperm(ntok, device=DEV).int()
        off = 0
        for b, n in enumerate(lens):
            r2t[rpi[b], :n] = perm[off:off + n]
            off += n
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
        tri, pool, fi = memories(S, W, Kc, M, Hkv, D, dtype, G, page, kv)
        store_random([tri, pool, fi], rpi, seq_lens, S, W, Kc, kc, vc, r2t, holes=page > 1)
        q = torch.randn(B, Hkv * G, D, device=DEV, dtype=dtype)
        sm = D ** -0.5
        tag = (f"G{G} D{D} {str(dtype)[6:]} lens{lens[:4]}" + (f" pages of {page}" if page > 1 else "")
               + (" kv fp8" if kv is not None else ""))
        fi.plan_fast(B, sm)
        out = torch.full_like(q, float("nan"))

        def step():
            fi.attend_fast(0, q, kc, vc, r2t, rpi, seq_lens, sm, out=out,
                           fast_plan=fi.fast_lists(rpi, seq_lens))

        def want():
            return ref(q, kc, vc, r2t, rpi, seq_lens, tri.fast_ws[rpi], tri.packed_k[0], tri.packed_v[0],
                       tri.packed_len, sm, holes=tri.sel_pos[0] if page > 1 else None, hole_base=S)

        step()
        ok &= check(f"flashinfer_fast {tag}", KH.rel_err(out, want()), 2e-2)
        ok &= check(f"triton_fast {tag}", KH.rel_err(tri.attend_fast(0, q, kc, vc, r2t, rpi, seq_lens, sm),
                                                      want()), 2e-2)
        ok &= check(f"triton_pool_fast {tag}", KH.rel_err(pool.attend_fast(0, q, kc, vc, r2t, rpi, seq_lens, sm),
                                                          want()), 2e-2)
        # a graph of the step, replayed after the state moved: shorter contexts (down to
        # one window token), new selections with fewer positions, new queries
        s_ = torch.cuda.Stream()
        s_.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s_):
            step()
        torch.cuda.current_stream().wait_stream(s_)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        for trial in range(3):
            n_sel = [max(S + 1, int(n * (0.3 + 0.3 * trial))) for n in lens]
            store_random([tri, pool, fi], rpi, torch.tensor(n_sel, dtype=torch.int32, device=DEV), S, W,
                         max(1, Kc // (trial + 2)), kc, vc, r2t, holes=page > 1)
            seq_lens.copy_(torch.tensor([min(n, s + 1 + trial * 7) for n, s in zip(lens, n_sel)]))
            q.normal_()
            out.fill_(float("nan"))
            g.replay()
            ok &= check(f"flashinfer_fast graph replay {trial} {tag}", KH.rel_err(out, want()), 2e-2)
        del kc, vc, g
    return ok


def run_config(N, B, l2):
    Hkv, G, D, S, W, Kc = (KH.DIMS[k] for k in ("Hkv", "G", "D", "S", "W", "Kc"))
    Hq, P, elt = Hkv * G, S + Kc, 2
    cfg = {"N": N, "B": B}
    log(f"== N={N} B={B}")
    dense_bytes = B * N * Hkv * D * 2 * elt
    fast_bytes = B * Hkv * (P + W) * D * 2 * elt + 2 * B * Hq * D * elt
    n_sets = max(1, min(16, math.ceil(4 * l2 / fast_bytes)))
    n_dense = max(1, min(8, math.ceil(4 * l2 / dense_bytes)))
    st = KH.build_state(B, Hkv, G, D, N, torch.bfloat16, max(n_sets, n_dense), 1, W, seed=N + B)
    kc, vc, r2t = st["k_cache"], st["v_cache"], st["req_to_token"]
    del st["packed_k"], st["packed_v"]
    sets = st["sets"]
    sm = D ** -0.5
    res = {}
    sd = []
    for s in sets[:n_dense]:
        idx = r2t[s["req_pool_indices"]].long()
        sd.append((s["q"][:, :, None], kc[idx].permute(0, 2, 1, 3).contiguous(),
                   vc[idx].permute(0, 2, 1, 3).contiguous()))
    res["sdpa"] = timed("dense_sdpa", cfg, [
        (lambda a=a: F.scaled_dot_product_attention(a[0], a[1], a[2], enable_gqa=True, scale=sm))
        for a in sd], dense_bytes)
    del sd
    torch.cuda.empty_cache()
    sets = sets[:n_sets]
    M = len(st["sets"]) * B
    tri, pool, fi = memories(S, W, Kc, M, Hkv, D, torch.bfloat16, G)
    for s in sets:
        store_random([tri, pool, fi], s["req_pool_indices"], s["seq_lens"], S, W, Kc, kc, vc, r2t)
    for name, mem in (("fast_triton", tri), ("fast_triton_pool", pool)):
        res[name] = timed(name, cfg, [
            (lambda s=s, mem=mem: mem.attend_fast(0, s["q"], kc, vc, r2t, s["req_pool_indices"], s["seq_lens"],
                                                  sm, out=s["out"])) for s in sets], fast_bytes)
    fi.plan_fast(B, sm)
    res["fi"] = timed("fast_flashinfer", cfg, [
        (lambda s=s: fi.attend_fast(0, s["q"], kc, vc, r2t, s["req_pool_indices"], s["seq_lens"], sm,
                                    out=s["out"], fast_plan=fi.fast_lists(s["req_pool_indices"], s["seq_lens"])))
        for s in sets], fast_bytes)
    fd, n = fi._fi, B * Hkv * fi._fi.R
    kv = (kc.view(-1, 1, 1, D), vc.view(-1, 1, 1, D))
    res["fi_run"] = timed("flashinfer_run_only", cfg, [
        lambda: fd.wrappers[B].run(fd.qrows[:n], kv, out=fd.o_rows[:n], lse=fd.lse_rows[:n], return_lse=True)],
        fast_bytes)
    s0, rpi0 = sets[0], sets[0]["req_pool_indices"]
    fl = fi.fast_lists(rpi0, s0["seq_lens"])
    res["fi_lists_step"] = timed("flashinfer_fast_lists_per_step", cfg, [
        lambda: fi.fast_lists(rpi0, s0["seq_lens"])], fast_bytes)
    res["fi_lists"] = timed("flashinfer_build_lists", cfg, [
        lambda: FF.build_lists(s0["q"], r2t, rpi0, fl.lengths, fl.start, s0["seq_lens"], fl.win_start, fi.n_sinks,
                               fi.sel_pos[0], fi.sel_count, fd.indptr, fd.pages, fd.qrows, fd.C, fd.cap)],
        fast_bytes)
    res["fi_merge"] = timed("flashinfer_merge_rows", cfg, [
        lambda: FF.merge_rows(fd.o_rows[:n], fd.lse_rows[:n], s0["out"], fd.C, R=fd.R)], fast_bytes)
    res["fi_layer"] = timed("flashinfer_layer_given_lists", cfg, [
        lambda: fi.attend_fast(0, s0["q"], kc, vc, r2t, rpi0, s0["seq_lens"], sm, out=s0["out"], fast_plan=fl)],
        fast_bytes)
    ms = lambda r: r.get("ms") if isinstance(r, dict) else None
    do = lambda r: r.get("do_bench_ms") if isinstance(r, dict) else None
    summ = {"N": N, "B": B, "sdpa_ms": ms(res["sdpa"]), "triton_ms": ms(res["fast_triton"]),
            "triton_pool_ms": ms(res["fast_triton_pool"]), "flashinfer_ms": ms(res["fi"]),
            "flashinfer_do_bench_ms": do(res["fi"]), "flashinfer_run_ms": ms(res["fi_run"]),
            "rows_per_list": fd.C, "fast_bytes": fast_bytes,
            **{f"{k}_ms": ms(res[k]) for k in ("fi_lists_step", "fi_lists", "fi_merge", "fi_layer")}}
    RESULTS.setdefault("summary", []).append(summ)
    del tri, pool, fi, st, kc, vc
    torch.cuda.empty_cache()


def e2e(n=8192, b=4, steps=48):
    """The backend end to end (bench/harness.py, Qwen3-4B shape, dummy weights,
    eager steps): the same SFI decode with each fast path; same tokens? time per step."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import harness as bench
    from sfi_sglang.integration import state

    model = bench.DummyModel(bench.SHAPES["qwen3-4b"], torch.bfloat16, DEV)
    first = torch.arange(b, device=DEV) + 100
    out = {}

    def forced(st, ids):
        """Logits [B, T, V] of SFI steps fed the tokens `ids` [B, T] (teacher forcing, so
        both paths see the same inputs even where a near-tie flips a greedy token)."""
        st.reset(first)
        logits = []
        for t in range(ids.shape[1]):
            st.sfi.init_forward_metadata(st.fb)
            logits.append(model.step(st.sfi, st.fb, return_logits=True).float())
            st.advance(ids[:, t])
        return torch.stack(logits, 1)

    for fp in ("triton", "flashinfer"):
        cfg = CFG.SFIConfig(refresh="interval", max_interval=24, min_gap=16, fast_path=fp)
        st = bench.Setup(model, cfg, n, b, steps + 2, DEV, torch.bfloat16)
        run = bench.Runner(st, use_graphs=False)
        run.run_sfi(first, steps)  # warm-up (Triton/FlashInfer compiles)
        ids, t, slow = run.run_sfi(first, steps)
        ref_ids = out["triton"]["ids"] if fp == "flashinfer" else ids
        out[fp] = {"ids": ids, "step_ms": t / steps * 1e3, "slow_steps": slow,
                   "forced": forced(st, ref_ids[:, :steps])}
        state.BACKENDS.remove(st.sfi)
        del st, run
        torch.cuda.empty_cache()
    a, c = out["triton"]["ids"], out["flashinfer"]["ids"]
    diff = (a != c).any(0).nonzero()
    lt, lf = out["triton"]["forced"], out["flashinfer"]["forced"]
    top2 = lt.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 0.05  # steps whose top-1 is not a near-tie
    rel = ((lf - lt).norm(dim=-1) / lt.norm(dim=-1))
    res = {"context": n, "batch": b, "steps": steps, "tokens_equal": bool(torch.equal(a, c)),
           "agreement": float((a == c).float().mean()),
           "first_diff_step": int(diff[0]) if diff.numel() else None,
           "forced_logits_rel_err_max": float(rel.max()), "forced_logits_rel_err_median": float(rel.median()),
           "forced_top1_agree_clear_steps": float((lt.argmax(-1) == lf.argmax(-1))[clear].float().mean()),
           "forced_clear_steps": int(clear.sum()),
           **{f"{fp}_step_ms": out[fp]["step_ms"] for fp in out},
           **{f"{fp}_slow_steps": out[fp]["slow_steps"] for fp in out}}
    RESULTS["e2e"] = res
    log("e2e " + json.dumps(res))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--e2e", action="store_true", help="also the backend end to end, both fast paths")
    ap.add_argument("--configs", default="8192x1,8192x8,32768x1,32768x8,131072x1,131072x8",
                    help="NxB timing configs ('' for none)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    import flashinfer

    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 60 * 2**20)
    RESULTS["env"] = {"device": props.name, "torch": torch.__version__,
                      "flashinfer": flashinfer.__version__}
    log(json.dumps(RESULTS["env"]))
    path = os.path.join(args.out, "flashinfer_h200.json" if args.configs else "flashinfer_h200_e2e.json")
    try:
        RESULTS["all_checks_ok"] = bool(correctness())
    except Exception:
        RESULTS["errors"].append("correctness: " + traceback.format_exc()[-2000:])
        log(traceback.format_exc()[-2000:])
        RESULTS["all_checks_ok"] = False
    log(f"checks ok: {RESULTS['all_checks_ok']} ({time.time() - t0:.0f}s, includes FlashInfer's JIT build)")
    for N, B in [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",") if c]:
        try:
            run_config(N, B, l2)
        except Exception:
            RESULTS["errors"].append(f"config {N} {B}: {traceback.format_exc()[-1500:]}")
            log(traceback.format_exc()[-1500:])
        with open(path, "w") as f:
            json.dump(RESULTS, f, indent=1)
    if args.e2e:
        try:
            e2e()
        except Exception:
            RESULTS["errors"].append("e2e: " + traceback.format_exc()[-2000:])
            log(traceback.format_exc()[-2000:])
    RESULTS["wall_s"] = time.time() - t0
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1)
    for e in RESULTS["errors"]:
        log("ERROR:", e[-600:])
    f = lambda v, m=1e3: f"{v * m:8.1f}" if v is not None else f"{'-':>8}"
    log(f"{'N':>7} {'B':>2} {'sdpa_us':>8} {'tri_us':>8} {'pool_us':>8} {'fi_us':>8} {'fiRun':>8} {'fi/tri':>7}")
    for s in RESULTS.get("summary", []):
        r = (s["flashinfer_ms"] / s["triton_ms"]) if s["flashinfer_ms"] and s["triton_ms"] else None
        log(f"{s['N']:>7} {s['B']:>2} {f(s['sdpa_ms'])} {f(s['triton_ms'])} {f(s['triton_pool_ms'])}"
            f" {f(s['flashinfer_ms'])} {f(s['flashinfer_run_ms'])} {f(r, 1)}")
    log(f"checks ok={RESULTS['all_checks_ok']} wall {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
