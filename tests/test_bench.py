"""The bench harness (bench/harness.py) on the CPU at a tiny shape, and the `sfi` backend's
kernel path (packed SparseMemory + Triton kernels, interpreted on CPU tensors) against its
CPU reference path on the same decode steps."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

_REPO = pathlib.Path(__file__).resolve().parents[1]
CLI = [sys.executable, "bench/harness.py"]
sys.path.insert(0, str(_REPO / "bench"))  # the harness is not part of the package
TINY = ["--shape", "tiny", "--dtype", "float32", "--device", "cpu", "--sfi-budget", "16",
        "--sfi-window", "8", "--sfi-sinks", "4", "--reps", "2"]


@pytest.mark.parametrize("refresh", ["interval", "adaptive"])
def test_tiny_throughput_run(tmp_path, refresh):
    """adaptive: the trigger's signal is computed at every step, and at the harness's
    default threshold it never fires: the same slow steps."""
    out = tmp_path / "tp"
    r = subprocess.run(CLI + TINY + ["--configs", "10x2,60x3", "--steps", "12", "--slow-every", "4",
                                     "--sfi-refresh", refresh, "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=str(_REPO))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "tp.json").read_text())
    assert (tmp_path / "tp.png").stat().st_size > 0
    fit, long = res["rows"]
    # 10 + 12 + 1 tokens <= S + W + K = 28: every fast step attends to everything
    assert fit["fits_budget"] and fit["tokens_equal_dense"] == 1.0
    assert not long["fits_budget"]
    for row in res["rows"]:
        # refresh every 4 steps: timed steps 4, 8, 12 are slow (the untimed first step selects)
        assert row["slow_steps"] == 3, row
        assert row["dense_tok_s"] > 0 and row["sfi_tok_s"] > 0
        assert set(row["parts_ms"]) == {"none", "dense_attn", "fast_attn", "slow_attn", "dense_layer",
                                      "fast_layer"}


@pytest.mark.parametrize("args, fragment", [
    (["--configs", "8kx1"], "--configs"),
    (["--slow-every", "1"], "--slow-every"),
    (["--sfi-fast-path", "flashinfer"], "--no-cuda-graph"),
    (["--sfi-fast-path", "cuda"], "--sfi-fast-path"),
])
def test_bad_options_exit_2(args, fragment, capsys):
    import harness

    with pytest.raises(SystemExit) as exit_:
        harness.main(TINY + args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and fragment in err, err[-2000:]


_KERNEL_VS_REFERENCE = r"""
import sys
import torch
sys.path.insert(0, "bench")
import harness as bench
from sfi_sglang.method.config import SFIConfig

packed = sys.argv[1] == "kernel"
records = {}
# the kernel process runs both Triton fast paths (the packed copy, the pool read in place),
# with single tokens and with whole pages of 6 (two pages: at most 12 positions of a count
# of 16, the rest of each head's entries empty)
# with at most 2 slow rows a step (the third row's slow steps come a step later), over an
# fp8 KV pool (its packed copies fp8 too), and with 2 memory rows for 3 requests (the third
# runs dense)
fp8 = torch.float8_e4m3fn
runs = ((("triton", "triton", 1, 0, None, 0), ("triton-pages", "triton", 6, 0, None, 0),
         ("triton-pool-pages", "triton-pool", 6, 0, None, 0), ("triton-pool-limit", "triton-pool", 1, 2, None, 0),
         ("triton-fp8", "triton", 1, 0, fp8, 0), ("triton-rows", "triton", 1, 0, None, 2))
        if packed else (("reference", "triton", 1, 0, None, 0), ("reference-pages", "triton", 6, 0, None, 0),
                        ("reference-limit", "triton", 1, 2, None, 0), ("reference-fp8", "triton", 1, 0, fp8, 0),
                        ("reference-rows", "triton", 1, 0, None, 2)))
for name, fast_path, page, limit, kv_dtype, rows in runs:
    torch.manual_seed(0)
    cfg = SFIConfig(sinks=4, window=8, budget=16, dense_layers=(0,), refresh="interval",
                    max_interval=3, min_gap=1, fast_path=fast_path, selection_page=page, max_slow_rows=limit,
                    memory_rows=rows)
    model = bench.DummyModel(bench.SHAPES["tiny"], torch.float32, "cpu")
    s = model.s
    st = bench.Setup(model, cfg, 70, 3, 8, "cpu", torch.float32, packed=packed, all_slow=False,
                     kv_dtype=kv_dtype)
    mem = st.sfi.memory
    assert mem.packed == packed
    st.reset(torch.tensor([5, 7, 11]))
    st.sfi.step.dense[st.fb.req_pool_indices[1], 2] = True  # a row with its own dense layer 2
    record = records[name] = []
    for step in range(5):  # slow, fast, fast, slow, fast
        st.sfi.init_forward_metadata(st.fb)
        slow = st.sfi.meta.rows.slow.clone()
        g = torch.Generator().manual_seed(100 + step)
        per_layer = []
        for L in model.layers:
            q = torch.randn(3, s.heads * s.head_dim, generator=g)
            k = torch.randn(3, s.kv_heads, s.head_dim, generator=g)
            v = torch.randn(3, s.kv_heads, s.head_dim, generator=g)
            per_layer.append(st.sfi.forward_decode(q, k, v, L.attn, st.fb))
        record.append({"slow": slow, "out": torch.stack(per_layer), "sel_pos": mem.sel_pos.clone(),
                       "sel_count": mem.sel_count.clone(), "on": st.sfi.meta.rows.on.clone()})
        st.advance(torch.tensor([1, 2, 3]))
torch.save(records, sys.argv[2])
print("OK")
"""


def test_backend_kernel_path_equals_reference_path(tmp_path):
    """Same decode steps (slow, fast, fast, slow, ...) through the backend with the packed
    kernel memory (Triton, interpreted, in a process with TRITON_INTERPRET=1 set before
    triton's import; its slow steps select for every layer at once at the step's end), with
    the kernel reading the pool in place (--sfi-fast-path triton-pool) and with the torch
    reference (layer by layer, in a process without it): same outputs, same selections,
    also for a row with its own dense layer; and so with whole pages (--sfi-selection-page),
    whose edge pages leave a head fewer positions than the selection's count, and with at
    most 2 slow rows a step (--sfi-max-slow-rows: the dense pass's logits in score rows),
    over an fp8 KV pool (--kv-cache-dtype fp8_e4m3), and with 2 memory rows for 3 requests
    (--sfi-memory-rows: the kernels index the memory by row; the third request runs dense)."""
    import torch

    records = {}
    for path, interpret in (("reference", "0"), ("kernel", "1")):
        out = tmp_path / f"{path}.pt"
        env = dict(os.environ, TRITON_INTERPRET=interpret)
        r = subprocess.run([sys.executable, "-c", _KERNEL_VS_REFERENCE, path, str(out)], capture_output=True,
                           text=True, timeout=900, cwd=str(_REPO), env=env)
        assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
        records.update(torch.load(out))
    kinds = set()
    limited = [r["slow"].tolist() for r in records["reference-limit"]]
    assert limited[:2] == [[True, True, False], [False, False, True]], limited  # the third put off
    assert [r["on"].tolist() for r in records["reference-rows"]] == [[True, True, False]] * 5  # no row: dense
    assert records["reference-rows"][0]["sel_pos"].shape[1] == 3  # 2 rows and row 0
    for ref_name, paths in (("reference", ("triton",)), ("reference-pages", ("triton-pages", "triton-pool-pages")),
                            ("reference-limit", ("triton-pool-limit",)), ("reference-fp8", ("triton-fp8",)),
                            ("reference-rows", ("triton-rows",))):
        for step, ref in enumerate(records[ref_name]):
            kinds |= {"slow" if x else "fast" for x in ref["slow"].tolist()}
            if ref_name == "reference-pages" and step > 0:  # every head held pages, fewer than its count
                held = (ref["sel_pos"][1:, 1:4] >= 0).sum(-1)  # sparse layers x rows x heads
                assert ((held > 0) & (held <= 12)).sum() >= held.numel() - 2, held  # row 1's own dense layer
            for path in paths:
                ker = records[path][step]
                assert torch.equal(ref["slow"], ker["slow"]), (path, step)
                err = ((ref["out"] - ker["out"]).norm() / ref["out"].norm()).item()
                assert err < 1e-5, (path, step, ref["slow"], err)
                assert torch.equal(ref["sel_count"], ker["sel_count"]), (path, step)
                assert torch.equal(ref["sel_pos"], ker["sel_pos"]), (path, step)
    assert kinds == {"fast", "slow"}, kinds


def test_real_smollm2_fits_budget_sfi_equals_dense(model_path, tokenizer):
    """The Llama path of the harness's model on the real SmolLM2 weights (fp32, CPU): its
    prefill gives HF transformers' logits, a dense decode step continues the prefill, and
    with the context inside S + W + K the SFI backend (slow and fast steps) decodes the
    same greedy tokens as dense (bench/smollm2_h200.py runs this at 1.5K/4K on the H200)."""
    import torch
    from transformers import AutoModelForCausalLM

    import harness as bench
    from sfi_sglang.integration import state
    from sfi_sglang.method.config import SFIConfig

    torch.manual_seed(0)
    path = pathlib.Path(model_path)
    config = json.loads((path / "config.json").read_text())
    model = bench.DummyModel.from_hf(config, [path / "model.safetensors"], torch.float32, "cpu")
    assert model.s.tied and not model.s.qk_norm and model.s.rope_theta == 100000.0
    ids = torch.tensor(tokenizer.encode("The essay explains why startups in Silicon Valley grow fast: "
                                        "founders, investors and engineers live close to each other, and"))
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    del hf
    ks, vs, logits = model.prefill(ids, all_logits=True)
    assert (logits - ref).abs().max().item() < 1e-3 * ref.abs().max().item()

    steps, n = 6, ids.numel()
    cfg = SFIConfig(sinks=4, window=16, budget=32, refresh="interval", max_interval=3, min_gap=1)
    assert n + steps + 1 <= cfg.sinks + cfg.window + cfg.budget
    st = bench.Setup(model, cfg, n, 1, steps + 2, "cpu", torch.float32)
    try:
        st.write_prompt([k[:-1] for k in ks], [v[:-1] for v in vs])
        first = ids[-1:]
        st.reset(first)
        step0 = model.step(st.dense, st.fb, return_logits=True)[0]  # decodes the last prompt token
        assert (step0 - logits[-1]).abs().max().item() < 1e-3 * logits[-1].abs().max().item()
        run = bench.Runner(st, use_graphs=False)
        dense_ids, _ = run.run_dense(first, steps)
        sfi_ids, _, n_slow = run.run_sfi(first, steps)
        assert n_slow == 2  # timed steps 3 and 6 (the first step selects)
        assert torch.equal(dense_ids, sfi_ids[:, :steps]), (dense_ids, sfi_ids)
    finally:
        state.BACKENDS.remove(st.sfi)


def test_real_sglang_throughput_driver(tmp_path):
    """bench/sglang_h200.py (the driver of the real-SGLang H200 runs, bench/NOTES.md
    section 6) on SGLang's CPU engine: a dummy-weight Qwen3 config, token-id prompts, the
    `sfi` backend with a forced slow step every 4 tokens, counted in meta_info (a memory
    per request slot: contexts of 256 are within S + W + K and take no memory row). The
    requests stream (--stream), so each gets an output per token and meta_info at each."""
    steps, every = 8, 4
    r = subprocess.run([sys.executable, "bench/sglang_h200.py", "--engines", "sfi", "--shape", "tiny",
                        "--configs", "256x2", "--steps", str(steps), "--slow-every", str(every), "--memory-rows", "0",
                        "--stream", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, cwd=str(_REPO))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "sglang_h200.json").read_text())
    (run,) = res["runs"]
    assert run["engine"] == "sfi" and run["context_length"] == 512 and "error" not in run, run
    assert run["launch"]["load_format"] == "dummy" and run["launch"]["sfi_refresh"] == "interval"
    assert [(row["context"], row["batch"]) for row in res["rows"]] == [(256, 1), (256, 2)]
    for row in res["rows"]:
        b, d = row["batch"], row["detail"]["sfi"]
        assert d["slow_steps"] + d["fast_steps"] == b * steps, row
        assert b * (steps // every - 1) <= d["slow_steps"] <= b * (steps // every + 1), row
        assert d["chunks"] >= b * steps, row  # streamed: about one output per token


_WARM_UP = r"""
import functools
import sys
from types import SimpleNamespace
import torch
sys.path.insert(0, "tests")
from test_kernels import recorded_variants
sys.path.insert(0, "bench")
import harness as bench
import sfi_sglang.method.selector as S
from sfi_sglang.integration.warmup import warm_up
from sfi_sglang.method.config import SFIConfig

# on CUDA tensors select() takes the Selector's kernels and the top-k kernel; on these
# CPU ones (interpreted), ask for them
S.select = functools.partial(S.select, fused=True)
S._top_k_from_key = lambda key, k: S._topk_kernel()(key, k)

cfg = SFIConfig(sinks=4, window=8, budget=16, dense_layers=(0,), refresh="interval",
                max_interval=3, min_gap=1)
model = bench.DummyModel(bench.SHAPES["tiny"], torch.float32, "cpu")
s = model.s
for n in (70, 600):  # score buffers capped at req_to_token's width, and not
    st = bench.Setup(model, cfg, n, 3, 8, "cpu", torch.float32, packed=True)
    with recorded_variants() as warm:
        warm_up(st.sfi)
    assert not st.sfi.memory.sel_count[1:3].any() and not st.sfi.slots.requests, "warm-up slots not reset"
    with recorded_variants() as keys:
        st.reset(torch.tensor([5, 7, 11]))
        kinds = set()
        for step in range(4):  # slow, fast, fast, slow
            st.sfi.init_forward_metadata(st.fb)
            kinds |= {"slow" if x else "fast" for x in st.sfi.meta.rows.slow.tolist()}
            g = torch.Generator().manual_seed(step)
            for L in model.layers[1:]:  # layer 0 is dense: the harness's own dense backend
                q = torch.randn(3, s.heads * s.head_dim, generator=g)
                k = torch.randn(3, s.kv_heads, s.head_dim, generator=g)
                st.sfi.forward_decode(q, k, k, L.attn, st.fb)
            st.advance(torch.tensor([1, 2, 3]))
        assert kinds == {"fast", "slow"}, kinds
        # and a prompt's end (forward_extend's selection from its last rows)
        rows = cfg.bootstrap_rows
        ext = SimpleNamespace(extend_start_loc=torch.arange(3) * rows, extend_seq_lens=torch.full((3,), rows),
                              req_pool_indices=st.fb.req_pool_indices, seq_lens=st.fb.seq_lens)
        for L in model.layers[1:]:
            st.sfi.bootstrap(torch.randn(3 * rows, s.heads * s.head_dim), L.attn, ext)
    assert {"_fast_decode_kernel", "_row_stats_kernel", "_write_kernel", "_store_kernel", "_pool_kernel"} <= set(keys)
    new = sorted(name for name, v in keys.items() if not v <= warm.get(name, set()))
    assert not new, f"compiled after the warm-up: {new}"
print("OK")
"""


def test_warm_up_compiles_what_decode_steps_launch():
    """integration.warmup.warm_up, run when the backend is made, launches every kernel variant that decode steps
    (slow and fast rows) launch later: no request waits for a compile. Triton's cache key
    of each launch (test_kernels._variant_key) under the interpreter, in a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _WARM_UP], capture_output=True, text=True,
                       timeout=900, cwd=str(_REPO), env=env)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_skipped_and_always_run_slow_pass_decode_the_same(monkeypatch):
    """What a decode CUDA graph does (its IF node skips a layer's slow pass when no row is
    slow or dense there) against what an eager CUDA step does (the slow pass always runs,
    masked per row): the same tokens, slow steps and selections, over steps with and
    without slow rows and a row with an extra dense layer (CPU reference path; an SFI-off
    row would make every layer run the pass: bench/graph_check_h200.py has one on the GPU)."""
    import torch

    import harness as bench
    from sfi_sglang.integration import graph_if, state
    from sfi_sglang.method.config import SFIConfig

    cfg = SFIConfig(sinks=4, window=8, budget=16, dense_layers=(0,), refresh="interval",
                    max_interval=3, min_gap=1)
    model = bench.DummyModel(bench.SHAPES["tiny"], torch.float32, "cpu")
    first = torch.tensor([5, 7, 11])
    runs = []
    for always in (False, True):
        if always:
            monkeypatch.setattr(graph_if, "run_if", lambda pred, body: body())
        st = bench.Setup(model, cfg, 70, 3, 12, "cpu", torch.float32)
        be, reset = st.sfi, st.reset
        slots = st.fb.req_pool_indices.tolist()

        def mixed(ids, reset=reset, be=be, st=st, slots=slots):
            reset(ids)
            be.step.dense[slots[1], 2] = True  # its own dense layer 2

        st.reset = mixed
        try:
            ids, _, slow = bench.Runner(st, False).run_sfi(first, 10)
            runs.append((ids, slow, be.memory.sel_pos.clone(), be.memory.counts.clone()))
        finally:
            state.BACKENDS.remove(be)
    (ids0, slow0, sel0, counts0), (ids1, slow1, sel1, counts1) = runs
    assert slow0 >= 2 and torch.equal(ids0, ids1) and slow0 == slow1
    assert torch.equal(sel0, sel1) and torch.equal(counts0, counts1)
    assert counts0[slots[0], 0] > 0  # fast steps happened, where the pass was skipped


def test_sfi_runs_teacher_forced():
    """Runner.run_sfi(forced=...), what the graph check compares two fast paths with: after
    step k it feeds forced[:, k], not its pick. Fed its own free run's picks it picks them
    again (the feed is aligned to the step); fed other tokens, its first pick (made before
    any feed) is the free run's, the later ones differ, and the batch ends on the last fed.
    gaps=True: the logit of each pick less that of the fed token, in rounding steps: 0 where
    they agree, positive exactly where they differ."""
    import torch

    import harness as bench
    from sfi_sglang.integration import state
    from sfi_sglang.method.config import SFIConfig

    cfg = SFIConfig(sinks=4, window=8, budget=16, refresh="interval", max_interval=3, min_gap=1)
    model = bench.DummyModel(bench.SHAPES["tiny"], torch.float32, "cpu")
    first = torch.tensor([5, 7, 11])
    st = bench.Setup(model, cfg, 70, 3, 12, "cpu", torch.float32)
    try:
        run = bench.Runner(st, False)
        free, _, _ = run.run_sfi(first, 8)
        again, _, _ = run.run_sfi(first, 8, forced=free, gaps=True)
        assert torch.equal(again, free) and run.gaps.shape == free.shape and not run.gaps.any()
        other = (free * 7 + 3) % bench.SHAPES["tiny"]["vocab"]
        fed, _, _ = run.run_sfi(first, 8, forced=other, gaps=True)
        assert torch.equal(fed[:, 0], free[:, 0]) and not torch.equal(fed[:, 1:], free[:, 1:])
        assert torch.equal(st.fb.input_ids, other[:, -1])
        assert torch.equal(run.gaps > 0, fed != other) and (run.gaps >= 0).all()
        assert (run.margins > 0).all() and (run.gaps >= run.margins)[fed != other].all()
        x = torch.tensor([1.0, 3.0, -0.3], dtype=torch.bfloat16)  # spacings 2^-7, 2^-6, 2^-9
        assert bench.rounding_step(x).tolist() == [2 ** -7, 2 ** -6, 2 ** -9]
    finally:
        state.BACKENDS.remove(st.sfi)


def test_speed_merge_copies_each_row_whole_from_one_run(tmp_path):
    """bench/plot_speed_h200.py --merge: a later call wins the rows it shares, every row names
    its call, and a row without both SFI and a dense engine (a call cut by its deadline) is
    left out, so no ratio mixes two runs."""
    import plot_speed_h200

    def call(name, rows):
        p = tmp_path / name
        p.write_text(json.dumps(dict(argv=[name], shape="qwen3-4b", slow_every=24, steps=48, rows=rows,
                                     sweep=[dict(context=8192, batch=1, cap=64, splits=64, us=90.0)])))
        return str(p)

    old = call("old.json", [dict(context=32768, batch=1, step_ms={"sfi": 7.3, "dense-best": 8.7}, speedup=1.19),
                            dict(context=131072, batch=1, step_ms={"sfi": 8.1, "dense": 61.2}, speedup=7.5)])
    new = call("new.json", [dict(context=32768, batch=1, step_ms={"sfi": 7.4, "dense-best": 8.7}, speedup=1.18),
                            dict(context=8192, batch=1, step_ms={"sfi": 7.1}),
                            dict(context=32768, batch="max", step_ms={"sfi": 13.3, "dense": 42.8},
                                 detail={"sfi": dict(batch=20, tokens_per_s=1500.0),
                                         "dense": dict(batch=22, tokens_per_s=513.0)},
                                 tokens_per_s={"sfi": 1500.0, "dense": 513.0}, batch_of={"sfi": 20, "dense": 22},
                                 throughput_ratio=2.92)])
    out = tmp_path / "merged.json"
    assert plot_speed_h200.merge(str(out), [old, new]).endswith("merged.png")
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["batch"], r["source"]) for r in rows] == [
        (32768, 1, "new.json"), (32768, "max", "new.json"), (131072, 1, "old.json")]
    assert rows[0]["step_ms"]["sfi"] == 7.4 and rows[2]["speedup"] == 7.5
    assert json.loads(out.read_text())["fused_ops"] == "torch"  # runs that name none ran torch's
    assert (tmp_path / "merged.png").stat().st_size > 0
    # a run with SGLang's JIT fused ops has a ~3 ms shorter step: not one table with the others
    jit = json.loads(pathlib.Path(new).read_text())
    (tmp_path / "jit.json").write_text(json.dumps(dict(jit, fused_ops="cuda")))
    with pytest.raises(SystemExit, match="different fused_ops"):
        plot_speed_h200.merge(str(out), [old, str(tmp_path / "jit.json")])


def test_request_plot_marks_the_slow_steps(tmp_path):
    """bench/plot_request.py (README's picture) redrawn from its committed run: the run's
    slow steps are the ones the request reported, each a step whose input token follows a
    sentence end (a boundary), and the picture is written."""
    import plot_request

    res = json.loads((_REPO / "bench/results/request_steps.json").read_text())
    assert res["slow_steps"] == len(res["slow_at"]) >= 1 and res["fast_steps"] > 3 * res["slow_steps"]
    for s in res["slow_at"]:  # decode step s reads output token s - 1; a sentence ended before it
        assert "".join(res["tokens"][:s - 1]).rstrip().endswith((".", "!", "?")), s
    out = tmp_path / "steps"
    assert plot_request.main(["--from-json", str(_REPO / "bench/results/request_steps.json"),
                              "--out", str(out)]) == 0
    assert (tmp_path / "steps.png").stat().st_size > 10_000


def test_speed_bound_reads_each_dense_engine_own_kernel():
    """bench/speed_h200.py's ideal bound takes a row's attention time from its best dense
    engine's own kernel (the triton sweep's best cap, or the FlashInfer sweep for
    dense-flashinfer), none where that was not swept; a context outside the sweep takes the
    nearest swept context's best cap instead of stopping the run."""
    import speed_h200 as S

    sw = [dict(context=32768, batch=1, cap=64, us=200.0), dict(context=32768, batch=1, cap=32, us=220.0),
          dict(context=131072, batch=1, cap=128, us=400.0)]
    assert S.best_cap(sw, 16384, 1)["cap"] == 64 and S.best_cap(sw, 131072, 1)["cap"] == 128
    assert S.best_cap(sw, 32768, 8)["cap"] == 64  # no batch-8 sweep: batch 1's
    res = dict(sweep=sw, fi_sweep=[dict(context=32768, batch=1, us=150.0)])
    assert S.attention_ms(res, "dense-flashinfer", 32768, 1, 36) == pytest.approx(36 * 0.150)
    assert S.attention_ms(res, "dense-best", 32768, 1, 36) == pytest.approx(36 * 0.200)
    assert S.attention_ms(res, "dense-flashinfer", 131072, 1, 36) is None


def test_profile_splits_decode_replays_from_the_prefill(tmp_path):
    """bench/sglang_h200.py's trace summary: a decode step is one CUDA-graph replay, its
    kernels those with the replay's correlation id (a prefill's kernels stay out); per
    replay the GPU's busy time (overlapping kernels counted once), its span, and the gap to
    the previous replay (host time the GPU waited for)."""
    import gzip

    import sglang_h200 as S

    def x(cat, name, ts, dur, corr):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, args=dict(correlation=corr))

    ev = [x("kernel", "prefill", 0, 500, 1), x("cuda_runtime", "cudaLaunchKernel", 0, 5, 1)]
    for i, t0 in enumerate((1000, 2000, 3100)):  # replays of 600 us with gaps of 400 and 500
        c = 10 + i
        ev += [x("cuda_runtime", "cudaGraphLaunch", t0 - 300, 20, c),
               x("kernel", "fast", t0, 100, c), x("kernel", "fast", t0 + 150, 100, c),
               x("kernel", "gemm", t0 + 200, 400, c)]  # overlaps the second "fast"
    path = tmp_path / "t.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(dict(traceEvents=ev), f)
    r = S.summarize_trace(str(path))["graph_replays"]
    assert (r["replays"], r["kernels_per_replay"]) == (3, 3)
    assert r["span_us"] == 600 and r["busy_us"] == 550  # 100 + (150 to 600)
    assert r["gap_us"] == 450  # the median of 400 and 500
    assert r["kernels"][0] == dict(name="gemm", us=400) and r["kernels"][1] == dict(name="fast", us=200)
    assert all(k["name"] != "prefill" for k in r["kernels"])
    assert S.graph_replays(ev[:2]) is None  # no replay: eager steps


def test_speed_launches_share_fixed_batch_configs():
    """bench/speed_h200.py launches each engine once for all fixed-batch configs (its
    context_length the longest), dense-best once per split cap, and each CONTEXTxmax config
    on its own launch after them."""
    import argparse

    import speed_h200 as S

    sw = [dict(context=16384, batch=1, cap=64, us=1.0), dict(context=131072, batch=1, cap=128, us=1.0)]
    args = argparse.Namespace(shape="qwen3-4b", mem_fraction=0.8, steps=48, slow_every=24)
    got = S.launches(args, ["sfi", "dense-best"], [(16384, 1), (32768, 8), (16384, 4), (131072, 1), (8192, 0)], sw)
    assert [(x["engine"], x["parts"]) for x in got[:3]] == [
        ("sfi", [(16384, [1, 4]), (32768, [1, 8]), (131072, [1])]),
        ("dense-best", [(16384, [1, 4]), (32768, [1, 8])]),
        ("dense-best", [(131072, [1])])]
    assert [got[1]["caps"]["best"], got[2]["caps"]["best"]] == [64, 128]
    assert [x["engine"] for x in got[3:]] == ["sfi", "dense-best"]
    assert all(x["parts"][0][0] == 8192 and x["caps"]["graph_batches"] for x in got[3:])
    # an engine name's suffixes: -fp8 (SGLang's fp8 KV cache), -rows, -autorows, -slowall, then -nodense, -pages
    caps = {"best": 64}
    assert S.engine_kwargs(args, "sfi-fipath-nodense-slowall-rows-fp8", "m", 32768, 8, caps) == {
        **S.engine_kwargs(args, "sfi", "m", 32768, 8, caps), "kv_cache_dtype": "fp8_e4m3",
        "sfi_max_slow_rows": 0, "sfi_dense_layers": "none", "sfi_fast_path": "flashinfer", "sfi_memory_rows": 4}
    assert S.engine_kwargs(args, "dense-flashinfer-fp8", "m", 32768, 8, caps)["kv_cache_dtype"] == "fp8_e4m3"
    assert S.engine_kwargs(args, "sfi-pool-autorows", "m", 32768, 8, caps) == {
        **S.engine_kwargs(args, "sfi-pool", "m", 32768, 8, caps), "sfi_memory_rows": "auto"}
    assert S.engine_kwargs(args, "sfi-triton", "m", 32768, 8, caps) == {
        **S.engine_kwargs(args, "sfi", "m", 32768, 8, caps), "sfi_fast_path": "triton"}


def test_paired_quality_kl_by_steps_since_a_refresh(capsys):
    """bench/paired_quality.py --by-age: a step's age is its distance to the clock method's
    latest slow step at or before it (prefill's end is step 0; slow steps themselves are
    left out), and every method is averaged over the same steps of each text."""
    import paired_quality

    def row(method, kl, slow, text):
        return {"kind": "teacher_forced", "context": 64, "retention": 0.15, "method": method,
                "source": "s", "start": text, "mean_kl": sum(kl) / len(kl), "top1_agreement": 1.0,
                "kl_steps": kl, "slow_at": slow}

    texts = [row("sfi", [1, 2, 3, 4, 5, 6], [3], 0), row("quest", [6, 6, 0, 6, 6, 9], [], 0),
             row("sfi", [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], [], 1)]
    by = {}
    for r in texts:
        by.setdefault((r["context"], r["retention"], r["method"]), {})[(r["source"], r["start"])] = r
    paired_quality.by_age(by, "sfi", lambda v, fmt: f"{sum(v) / len(v):{fmt}}")
    lines = {ln.split("|")[3].strip(): [c.strip() for c in ln.split("|")[4:8]]
             for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 64 ")}
    # sfi, text 0: ages 1, 2, (0), 1, 2, 3 -> 3.6 over ages 1-4; text 1: ages 1..12 -> 2 each
    assert lines["sfi"] == ["2.8000", "2.0000", "2.0000", "n/a"]
    assert lines["quest"] == ["6.6000", "n/a", "n/a", "n/a"]  # its text 0 only, same steps


def test_speed_rounds_keep_every_launch_and_the_median():
    """bench/speed_h200.py --rounds: a row keeps each launch's step time of an engine and
    reports their median (two launches of one engine differ by 3-6% at batch 1)."""
    import speed_h200

    row = {"step_ms": {}}
    for ms in (8.0, 9.0, 8.4):
        speed_h200.record_step(row, "sfi", ms)
    speed_h200.record_step(row, "dense-flashinfer", 9.1)
    speed_h200.record_step(row, "dense-flashinfer", 9.3)
    assert row["step_ms_rounds"] == {"sfi": [8.0, 9.0, 8.4], "dense-flashinfer": [9.1, 9.3]}
    assert row["step_ms"] == {"sfi": 8.4, "dense-flashinfer": 9.2}
