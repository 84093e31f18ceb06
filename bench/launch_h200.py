"""What each engine's launch costs with SGLang's own decode-graph batch sizes.

The speed runs capture decode graphs for the batches they time only; a server captures
SGLang's default list. `--sfi-dense-below` captures a dense graph beside the sparse one
for every batch size, and FlashInfer JIT-builds at its first launch: this prices both.
Run on the device machine like bench/speed_h200.sh runs bench/speed_h200.py:
    source bench/sglang_h200.sh; device_env fi; python3 bench/launch_h200.py --engines dense-flashinfer,sfi,sfi-below
Each engine is launched `--rounds` times in turn at `--context` with SGLang's default
--max-running-requests and decode-graph sizes, answers one short request, and shuts down.
Writes launch_h200.json to --out.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_h200 as S  # noqa: E402
import speed_h200 as P  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", default="dense-flashinfer,sfi,sfi-below")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="tokens the request decodes")
    S.add_launch_args(p, deadline_s=540)
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    import sfi_sglang

    args.tokenizer = S.tokenizer_or_default(args.tokenizer)
    os.makedirs(args.out, exist_ok=True)
    result = dict(argv=sys.argv[1:], device=P.set_device_hbm(), context=args.context, runs=[])
    ctx = S.context_length(args, args.context)
    path = S.model_dir(args.shape, args.tokenizer, max(ctx, 40960))
    for rnd in range(args.rounds):
        for name in args.engines.split(","):
            info = dict(engine=name, round=rnd)
            result["runs"].append(info)
            if time.perf_counter() - t_start > args.deadline_s:
                info["error"] = "skipped: past the deadline"
                continue
            kw = P.engine_kwargs(args, name, path, ctx, 1, {})
            for k in ("cuda_graph_bs_decode", "max_running_requests"):  # SGLang's defaults
                kw.pop(k, None)
            engine = None
            try:
                t0 = time.perf_counter()
                engine = sfi_sglang.Engine(**kw)
                info["startup_s"] = round(time.perf_counter() - t0, 1)
                dt, _ = S.runner(engine)([[100 + i for i in range(64)]], args.steps)
                info["first_request_s"] = round(dt, 2)
            except Exception as e:
                info["error"] = repr(e)[:1000]
            finally:
                if engine is not None:
                    S.free_engine(engine)
            print(json.dumps(info), flush=True)
            with open(os.path.join(args.out, "launch_h200.json"), "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
