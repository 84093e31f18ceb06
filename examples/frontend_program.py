"""An SGLang frontend-language program (sgl.function: a long document, several gen
calls) run against `sfi-sglang serve` through RuntimeEndpoint.

    sfi-sglang serve --port 30000 &
    python examples/frontend_program.py --url http://127.0.0.1:30000

(--api-key KEY when the server was launched with --api-key.)
"""

import argparse

import sglang as sgl
from transformers import AutoTokenizer

from sfi_sglang.model import default_model_path
from sfi_sglang.texts import long_text


@sgl.function
def read_and_ask(s, document):
    s += sgl.user("Read this essay:\n\n" + document + "\n\nSummarise it in one sentence.")
    s += sgl.assistant(sgl.gen("summary", max_tokens=48, temperature=0))
    s += sgl.user("Now ask one question the author would like readers to think about.")
    s += sgl.assistant(sgl.gen("question", max_tokens=32, temperature=0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--context-tokens", type=int, default=1500)
    ap.add_argument("--api-key", default=None, help="the server's --api-key, if any")
    args = ap.parse_args()
    sgl.set_default_backend(sgl.RuntimeEndpoint(args.url, api_key=args.api_key))
    document = long_text(AutoTokenizer.from_pretrained(default_model_path()), args.context_tokens)
    state = read_and_ask.run(document=document)
    print("summary:", state["summary"].strip())
    print("question:", state["question"].strip())


if __name__ == "__main__":
    main()
