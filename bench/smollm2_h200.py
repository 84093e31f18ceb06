"""With REAL weights: SmolLM2-135M-Instruct (Llama) in the harness of
bench/harness.py (SGLang-layout pools, DenseBackend, and the product's
sfi backend, Runner/Setup), with a real prefill (DummyModel.prefill: causal attention in
torch, K/V and key norms written into the pools) and the real boundary table of the
tokenizer (boundary.boundary_tables, installed with backend.install_boundaries;
refresh="boundary", the product's default trigger policy).

  (a) context fits S + W + K: greedy dense vs SFI on a ~1.5K-token essay prompt, bf16 and
      fp32 (bf16 weights upcast): identical tokens? (with dense's top-2 logit margin)
  (b) context 4K > S + W + K (sinks 4, window 256, budget 512): SFI synchronous vs
      asynchronous maintenance (backend.selection.enable_async()): identical tokens?
      Time per step of dense, SFI sync, SFI async (CUDA graphs) and the slow steps.

The GPU machine has no needlehaystack and the model reaches it in pieces (64 MiB per call),
so this runs in two places:
  here:   python bench/smollm2_h200.py prepare
          -> .w0/ (config, tokenizer, prompt ids, boundary tables, manifest with sha256) and
             .w1/ ... .w5/ (the weights in bf16, <= 57 MB each), all ignored by git
  device: one `run` call per chunk, back to back (the machine goes back after 30 s idle),
          each carrying one folder and copying it to /root/sfiw: seen 2026-11-29, the repo
          copy of a carried ignored folder was GONE at the next call, /root/sfiw was kept.
            run(carry=[".w0", ".w1"]): mkdir -p /root/sfiw; cp -r .w0 .w1 /root/sfiw/
                (that call also ran `run --random --steps-a 16 --steps-b 32`: a smoke test
                 that compiles the Triton kernels)
            run(carry=[".w2"]): cp -r .w2 /root/sfiw/      (same for .w3, .w4)
            run(carry=[".w5"]): cp -r .w5 /root/sfiw/; for d in .w0 .w1 .w2 .w3 .w4; do
                [ -e $d ] || cp -r /root/sfiw/$d .; done; source bench/layout.sh;
                sfi_site /tmp/sfi-site; python3 -P
                bench/smollm2_h200.py run --out $OUT | tee $OUT/smollm2_h200.log
          `run` checks every chunk's size and sha256 against the manifest first.
Results: bench/results/smollm2_h200.{json,log}.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import pathlib
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness as bench  # noqa: E402
from sfi_sglang.integration import state  # noqa: E402
from sfi_sglang.method.config import SFIConfig  # noqa: E402

CHUNKS = [".w1", ".w2", ".w3", ".w4", ".w5"]
META = ".w0"
QUESTION = "\n\nSummarize the essay above in a few sentences."


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


# ---------------------------------------------------------------------- here
def prompt_ids(tok, n_text: int, start: int) -> list[int]:
    from sfi_sglang.texts import long_text

    text = long_text(tok, n_text, start=start) + QUESTION
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(chat, add_special_tokens=False)


def prepare(args) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from sfi_sglang.method.boundary import boundary_tables
    from sfi_sglang.model import default_model_path

    src = pathlib.Path(args.model or default_model_path())
    root = REPO
    exclude = root / ".git" / "info" / "exclude"
    have = exclude.read_text().split() if exclude.exists() else []
    with open(exclude, "a") as f:
        for d in [META] + CHUNKS:
            if f"/{d}/" not in have:
                f.write(f"/{d}/\n")
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    L = cfg["num_hidden_layers"]
    per = -(-L // (len(CHUNKS) - 1))  # layers per chunk after the embedding's
    groups = [["model.embed_tokens.weight", "model.norm.weight"]]
    for c in range(len(CHUNKS) - 1):
        groups.append([k for k in state for i in range(c * per, min(L, (c + 1) * per))
                       if k.startswith(f"model.layers.{i}.")])
    assert sorted(sum(groups, [])) == sorted(state), "every tensor in exactly one chunk"
    manifest = {}
    for d, names in zip(CHUNKS, groups):
        (root / d).mkdir(exist_ok=True)
        for old in (root / d).glob("*"):
            old.unlink()
        path = root / d / "part.safetensors"
        save_file({k: state[k].to(torch.bfloat16).contiguous() for k in names}, str(path),
                  metadata={"format": "pt"})
        manifest[f"{d}/part.safetensors"] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
        print(f"{d}: {len(names)} tensors, {path.stat().st_size / 1e6:.1f} MB")
    meta = root / META
    meta.mkdir(exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    is_b, is_c = boundary_tables(tok, "default", cfg["vocab_size"])
    prompts = {"a": prompt_ids(tok, 1450, 0), "b": prompt_ids(tok, 3950, 3)}
    torch.save({"prompts": prompts, "is_boundary": is_b, "is_content": is_c, "boundaries": "default"},
               meta / "inputs.pt")
    (meta / "config.json").write_text(json.dumps(cfg, indent=1))
    (meta / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    (meta / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print({k: len(v) for k, v in prompts.items()}, "prompt tokens;", int(is_b.sum()), "boundary ids")


# ---------------------------------------------------------------------- there
def check_weights(root: pathlib.Path) -> dict:
    """Every chunk present with its size and hash (the files persisted between calls)."""
    manifest = json.loads((root / META / "manifest.json").read_text())
    out = {}
    for rel, want in manifest.items():
        p = root / rel
        got = {"bytes": p.stat().st_size, "sha256": sha256(p)} if p.exists() else None
        out[rel] = got == want
        print(f"  {rel}: {'ok' if got == want else ('MISSING' if got is None else 'DIFFERENT')}")
    return out


def dense_margins(st, model, first, steps):
    """Eager dense decode with logits: ids [steps] and dense's top-1 minus top-2 logit [steps]."""
    st.reset(first)
    ids, margins = [], []
    for _ in range(steps):
        lg = model.step(st.dense, st.fb, return_logits=True).float()
        top = lg.topk(2, dim=-1).values
        nxt = lg.argmax(-1)
        ids.append(nxt.clone())
        margins.append((top[:, 0] - top[:, 1]).clone())
        st.advance(nxt)
    return torch.stack(ids, 1)[0], torch.stack(margins, 1)[0]


def experiment(model, ids, cfg, steps, tables, device, graphs, do_async):
    dtype = model.embed.dtype
    n = len(ids)
    st = bench.Setup(model, cfg, n, 1, steps + 2, device, dtype)
    if tables is not None:
        st.sfi.install_boundaries(tables["is_boundary"], tables["is_content"], tables["boundaries"], 1)
    ids_t = torch.tensor(ids, device=device)
    t = time.perf_counter()
    ks, vs, _ = model.prefill(ids_t[:-1])  # positions [0, n - 1); token n - 1 is the first decode input
    st.write_prompt(ks, vs)
    del ks, vs
    if device == "cuda":
        torch.cuda.synchronize()
    t_prefill = time.perf_counter() - t
    first = ids_t[-1:]
    run = bench.Runner(st, graphs)
    run.run_dense(first, steps)  # graph capture + warm-up
    dense_ids, t_dense = run.run_dense(first, steps)
    eager_ids, margins = dense_margins(st, model, first, steps)
    run.run_sfi(first, steps)  # warm-up: Triton variants, graph captures
    sfi_ids, t_sfi, n_slow = run.run_sfi(first, steps)
    dense_ids, sfi_ids = dense_ids[0], sfi_ids[0, :steps]
    eq = dense_ids == sfi_ids
    first_diff = int((~eq).nonzero()[0]) if not bool(eq.all()) else None
    row = {
        "context": n, "steps": steps, "dtype": str(dtype).replace("torch.", ""),
        "budget": {"sinks": cfg.sinks, "window": cfg.window, "budget": cfg.budget,
                   "S+W+K": cfg.sinks + cfg.window + cfg.budget},
        "fits_budget": n + steps + 1 <= cfg.sinks + cfg.window + cfg.budget,
        "prefill_s": t_prefill,
        "dense_step_ms": t_dense / steps * 1e3, "sfi_step_ms": t_sfi / steps * 1e3,
        # the first SFI decode step (no selection yet: forced slow) is not timed and not counted
        "slow_steps": n_slow, "slow_steps_incl_first": n_slow + 1,
        "sfi_equals_dense": bool(eq.all()), "sfi_dense_agree": float(eq.float().mean()),
        "first_diff_step": first_diff,
        "dense_graph_equals_eager": bool(torch.equal(dense_ids, eager_ids)),
        "dense_min_margin": float(margins.min()),
        "dense_margin_at_first_diff": float(margins[first_diff]) if first_diff is not None else None,
        "dense_ids": dense_ids.tolist(), "sfi_ids": sfi_ids.tolist(),
    }
    if do_async:
        st.sfi.selection.enable_async()
        arun = bench.Runner(st, graphs)
        arun.run_sfi(first, steps)
        a_ids, t_async, a_slow = arun.run_sfi(first, steps)
        st.sfi.selection.enable_async(False)
        a_ids = a_ids[0, :steps]
        aeq = a_ids == sfi_ids
        row.update({"async_step_ms": t_async / steps * 1e3, "async_slow_steps": a_slow,
                    "async_equals_sync": bool(aeq.all()),
                    "async_first_diff_step": int((~aeq).nonzero()[0]) if not bool(aeq.all()) else None,
                    "async_ids": a_ids.tolist()})
        del arun
    state.BACKENDS.remove(st.sfi)
    del st, run
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def run(args) -> int:
    root = REPO
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print("device:", torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch", torch.__version__)
    config = json.loads((root / META / "config.json").read_text())
    inputs = torch.load(root / META / "inputs.pt")
    present = None
    if args.random:
        print("RANDOM weights (smoke test) in the shape of", config.get("_model_name_or_path"))
    else:
        print("weights (bf16 chunks):")
        present = check_weights(root)
        if not all(present.values()):
            print("ABORT: weight chunks missing or different (see above)")
            if args.out:
                os.makedirs(args.out, exist_ok=True)
                with open(os.path.join(args.out, "smollm2_h200.json"), "w") as f:
                    json.dump({"error": "weight chunks missing", "chunks": present}, f, indent=1)
            return 3
    files = sorted(glob.glob(str(root / ".w[1-9]" / "*.safetensors")))

    def load(dtype):
        if args.random:
            return bench.DummyModel(bench.DummyModel.hf_shape(config), dtype, device)
        return bench.DummyModel.from_hf(config, files, dtype, device)

    tables = None if args.no_boundaries else inputs
    refresh = dict(refresh="interval", max_interval=24, min_gap=16) if args.no_boundaries else {}
    cap = args.prompt_cap
    pa, pb = inputs["prompts"]["a"], inputs["prompts"]["b"]
    if cap:
        pa, pb = pa[-cap:], pb[-cap:]
    graphs = not args.no_graph
    res = {"model": "SmolLM2-135M-Instruct (real weights, bf16 in transport)", "random_weights": args.random,
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
           "cuda_graphs": graphs and device == "cuda",
           "refresh": "interval 24" if args.no_boundaries else "boundary (tokenizer's real table, default spec)",
           "chunks_ok": present, "a": {}, "b": None}
    cfg_a = SFIConfig(sinks=4, window=256, budget=2048, **refresh)
    for name in args.dtypes_a.split(","):
        dtype = getattr(torch, name)
        model = load(dtype)
        row = experiment(model, pa, cfg_a, args.steps_a, tables, device, graphs, do_async=False)
        res["a"][name] = row
        print("(a)", name, json.dumps({k: v for k, v in row.items() if not k.endswith("_ids")}))
        del model
    cfg_b = SFIConfig(sinks=4, window=256, budget=512, **refresh)
    model = load(torch.bfloat16)
    row = experiment(model, pb, cfg_b, args.steps_b, tables, device, graphs, do_async=True)
    res["b"] = row
    print("(b) bfloat16", json.dumps({k: v for k, v in row.items() if not k.endswith("_ids")}))
    try:  # the generated text, for the eye
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(root / META / "tokenizer.json"))
        res["text"] = {"a_dense": tok.decode(res["a"][args.dtypes_a.split(",")[0]]["dense_ids"]),
                       "b_dense": tok.decode(row["dense_ids"]), "b_sfi": tok.decode(row["sfi_ids"])}
        for k, v in res["text"].items():
            print(f"{k}: {v[:300]!r}")
    except Exception as err:  # noqa: BLE001
        print("no text:", err)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "smollm2_h200.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("\n| run | dtype | context | steps | S+W+K | tokens equal | dense ms/step | SFI sync ms/step "
          "| SFI async ms/step | slow steps (+1st) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in res["a"].items():
        eq = "yes" if r["sfi_equals_dense"] else f"no, from step {r['first_diff_step']} " \
             f"(dense margin {r['dense_margin_at_first_diff']:.3g})"
        print(f"| (a) dense vs SFI | {name} | {r['context']} | {r['steps']} | {r['budget']['S+W+K']} | {eq} "
              f"| {r['dense_step_ms']:.3f} | {r['sfi_step_ms']:.3f} | - | {r['slow_steps']} (+1) |")
    r = res["b"]
    eq = "yes" if r["async_equals_sync"] else f"no, from step {r['async_first_diff_step']}"
    print(f"| (b) SFI sync vs async | {r['dtype']} | {r['context']} | {r['steps']} | {r['budget']['S+W+K']} "
          f"| {eq} (SFI vs dense agree {r['sfi_dense_agree']:.2f}) | {r['dense_step_ms']:.3f} "
          f"| {r['sfi_step_ms']:.3f} | {r['async_step_ms']:.3f} | {r['slow_steps']}/{r['async_slow_steps']} (+1) |")
    ok = all(r_["sfi_equals_dense"] for r_ in res["a"].values()) and r["async_equals_sync"]
    print("RESULT:", "OK" if ok else "MISMATCH (see table)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="here: bf16 chunks .w1-.w5 and inputs .w0")
    pp.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2)")
    pr = sub.add_parser("run", help="the checks (on the device)")
    pr.add_argument("--out", default=None)
    pr.add_argument("--device", default=None)
    pr.add_argument("--steps-a", type=int, default=128)
    pr.add_argument("--steps-b", type=int, default=256)
    pr.add_argument("--dtypes-a", default="bfloat16,float32")
    pr.add_argument("--prompt-cap", type=int, default=0, help="keep only the prompts' last N tokens")
    pr.add_argument("--random", action="store_true", help="random weights (smoke test, no chunks)")
    pr.add_argument("--no-boundaries", action="store_true", help="interval refresh every 24 steps")
    pr.add_argument("--no-graph", action="store_true")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
