"""`sfi-sglang`: serve, generate and eval, through stock SGLang with SFI."""

from __future__ import annotations

import argparse
import os
import sys

from sfi_sglang.method.config import SFIConfigError, add_cli_args, config_from_args


def _sfi_parser(prog: str, add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, add_help=add_help)
    add_cli_args(parser)
    return parser


def _sfi_config(parser: argparse.ArgumentParser, args):
    try:
        return config_from_args(args)
    except SFIConfigError as err:
        parser.error(str(err))  # exit code 2, message names the option


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _given(argv: list[str], name: str) -> bool:
    flag = _flag(name)
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def serve(argv: list[str]) -> int:
    parser = _sfi_parser("sfi-sglang serve", add_help=False)
    parser.add_argument("-h", "--help", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.help:
        parser.print_help()
        print("\nAny other option is passed to SGLang's server; its options follow.\n")
        from sglang.srt.server_args import prepare_server_args

        prepare_server_args(["--help"])
        return 0
    cfg = _sfi_config(parser, args)

    from sfi_sglang.engine import launch_kwargs

    given = {}
    for name in ("model_path", "attention_backend"):
        flag = _flag(name)
        keep = []
        it = iter(rest)
        for a in it:
            if a == flag:
                given[name] = next(it, "")
            elif a.startswith(flag + "="):
                given[name] = a.split("=", 1)[1]
            else:
                keep.append(a)
        rest = keep  # launch_kwargs gives them back (the model path resolved: a named model's folder)
    try:
        kwargs = launch_kwargs(given, cfg, enabled=not args.disable_sfi)
    except (ValueError, RuntimeError) as err:
        parser.error(str(err))
    for name, value in kwargs.items():
        if _given(rest, name) or value is False:
            continue
        rest += [_flag(name)] if value is True else [_flag(name), str(value)]

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()  # registers the `sfi` backend choice before SGLang parses its args
    server_args = prepare_server_args(rest)
    if not args.disable_sfi:
        try:
            cfg.check_server(server_args.tp_size, server_args.kv_cache_dtype)
        except SFIConfigError as err:
            parser.error(str(err))
    from sfi_sglang.engine import cpu_parallel_args

    # CPU engine with tp/dp > 1 (engine.py says why)
    for key, value in cpu_parallel_args(server_args.tp_size * server_args.dp_size
                                        * server_args.pp_size).items():
        setattr(server_args, key, value)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


def generate(argv: list[str]) -> int:
    parser = _sfi_parser("sfi-sglang generate", add_help=True)
    parser.description = "Generate one completion with SGLang (+SFI) and print it."
    parser.add_argument("--prompt", required=True, help="user message (or raw text with --raw)")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--model-path", default=None,
                        help="a model folder, or a named model: smollm2-135m (the default), "
                             "qwen2.5-coder-0.5b (sfi_sglang.model)")
    args = parser.parse_args(argv)
    cfg = _sfi_config(parser, args)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be a positive integer")

    from sfi_sglang.engine import Engine

    kwargs = {f"sfi_{k}": v for k, v in cfg.to_dict().items()}
    try:
        engine = Engine(model_path=args.model_path, disable_sfi=args.disable_sfi, **kwargs)
    except (ValueError, RuntimeError) as err:
        print(f"sfi-sglang generate: {err}", file=sys.stderr)
        return 1
    try:
        prompt = args.prompt
        if not args.raw:
            prompt = engine.tokenizer_manager.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        out = engine.generate(
            prompt, {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        )
    finally:
        engine.shutdown()
    print(out["text"])
    sfi = out["meta_info"].get("sfi")
    if sfi:
        print(f"[sfi] {sfi}", file=sys.stderr)
    return 0


def evaluate(argv: list[str]) -> int:
    if not argv or argv[0] != "quality":
        print("usage: sfi-sglang eval quality [options]   (--help for options)", file=sys.stderr)
        return 2
    from sfi_sglang.eval import main as eval_main

    return eval_main(argv[1:])


COMMANDS = {"serve": serve, "generate": generate, "eval": evaluate}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: sfi-sglang {serve,generate,eval} [options]\n\n"
              "  serve     launch SGLang's HTTP server with SFI (any `sglang serve` option)\n"
              "  generate  one completion on the command line\n"
              "  eval      eval quality: SFI and baselines against dense\n"
              "\n"
              "`sfi-sglang COMMAND --help` lists a command's options.",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
