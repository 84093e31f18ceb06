"""Batching never changes what a request gets (issue 16, item 1), probed on the CPU engine:
greedy tokens and slow_at of 8 long prompts (essays), alone vs in one batch,
at budget 128 / window 64 (contexts well beyond the memory).

    python bench/batch_invariance.py [MAX_NEW_TOKENS]   # prints one JSON line per prompt
"""
import json
import sys


def main():
    import sfi_sglang
    from sfi_sglang.texts import essays
    texts = list(essays().values())
    eng = sfi_sglang.Engine(sfi_budget=128, sfi_window=64, log_level="error")
    prompts = []
    for i in range(8):
        t = texts[i % len(texts)]
        start = 3000 * (i // len(texts)) + 500 * i
        body = t[start:start + 4500]
        prompts.append(f"Read this text:\n{body}\n\nSummarize it in detail.")
    sp = {"temperature": 0.0, "max_new_tokens": int(sys.argv[1]) if len(sys.argv) > 1 else 120}
    eng.flush_cache()
    batch = eng.generate(prompts, [sp] * len(prompts))
    alone = []
    for p in prompts:
        eng.flush_cache()
        alone.append(eng.generate(p, sp))
    res = []
    for i, (b, a) in enumerate(zip(batch, alone)):
        bi, ai = b["output_ids"], a["output_ids"]
        first = next((k for k, (x, y) in enumerate(zip(bi, ai)) if x != y), None)
        res.append({"i": i, "prompt_tokens": b["meta_info"]["prompt_tokens"], "equal": bi == ai,
                    "first_diff": first, "slow_at_equal": b["meta_info"]["sfi"]["slow_at"] == a["meta_info"]["sfi"]["slow_at"],
                    "slow_b": b["meta_info"]["sfi"]["slow_at"][:8], "slow_a": a["meta_info"]["sfi"]["slow_at"][:8]})
        print(json.dumps(res[-1]), flush=True)
    eng.shutdown()
    print("ALL_EQUAL", all(r["equal"] and r["slow_at_equal"] for r in res))


if __name__ == "__main__":
    main()
