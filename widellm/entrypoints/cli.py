"""``widellm`` command line: serve, generate, chat, bench, simulate (also ``python -m widellm``)."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys

from widellm.engine.arg_utils import EngineArgs
from widellm.entrypoints.config_file import apply_config_file
from widellm.entrypoints.server_args import add_server_cli_args

LOG_LEVEL_ENV = "WIDELLM_LOGGING_LEVEL"
DISTRIBUTION = "widellm"


def package_version() -> str:
    """The installed distribution's version (the package's own for a source tree run
    without installing)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        import widellm

        return widellm.__version__


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="per-request seed (--seed seeds the engine)")


def _sampling_params(args: argparse.Namespace):
    from widellm import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> None:
    from widellm import LLM

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    for out in llm.generate(args.prompt, _sampling_params(args), use_tqdm=False):
        print(out.outputs[0].text)


def cmd_chat(args: argparse.Namespace) -> None:
    from widellm.entrypoints.chat import run_chat

    run_chat(EngineArgs.from_cli_args(args), _sampling_params(args), args.message)


def cmd_serve(args: argparse.Namespace) -> None:
    if args.headless:
        from widellm.engine.headless import run_headless

        run_headless(EngineArgs.from_cli_args(args))
        return
    from widellm.entrypoints.api_server import run_server

    run_server(args)


def cmd_proxy(args: argparse.Namespace) -> None:
    from widellm.kv_transfer.proxy_main import run_proxy

    run_proxy(args)


def cmd_bench_throughput(args: argparse.Namespace) -> None:
    from widellm.bench.throughput import run

    run(args)


def cmd_bench_serve(args: argparse.Namespace) -> None:
    from widellm.bench.serve import main as bench_serve_main

    bench_serve_main(args)


def cmd_simulate(args: argparse.Namespace) -> None:
    from widellm.sim.cli import run

    run(args)


def build_parser() -> argparse.ArgumentParser:
    return build_parsers()[0]


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``widellm`` parser and its ``serve`` subparser (which --config fills)."""
    parser = argparse.ArgumentParser(prog="widellm")
    parser.add_argument("-v", "--version", action="version", version=package_version())
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    EngineArgs.add_cli_args(serve, positional_model=True)
    add_server_cli_args(serve)
    serve.set_defaults(func=cmd_serve)

    gen = sub.add_parser("generate", help="complete one or more prompts")
    gen.add_argument("prompt", nargs="+")
    _sampling_args(gen)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat in the terminal (one turn if MESSAGE is given)")
    chat.add_argument("message", nargs="?", default=None)
    _sampling_args(chat)
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(func=cmd_chat)

    proxy = sub.add_parser("proxy", help="OpenAI-compatible front over disaggregated prefill "
                                         "and decode instances")
    from widellm.kv_transfer.proxy_routing import add_proxy_cli_args

    add_proxy_cli_args(proxy)
    proxy.set_defaults(func=cmd_proxy)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput on random prompts")
    from widellm.bench.throughput import add_cli_args

    add_cli_args(tp)
    tp.set_defaults(func=cmd_bench_throughput)
    sv = bench_sub.add_parser("serve", help="load an OpenAI-compatible server over HTTP")
    from widellm.bench.serve_args import add_cli_args as add_serve_args

    add_serve_args(sv)
    sv.set_defaults(func=cmd_bench_serve)

    sim = sub.add_parser("simulate", help="simulate a wide-EP deployment in virtual time")
    from widellm.sim.cli import add_cli_args as add_simulate_args

    add_simulate_args(sim)
    # The parser rides along so main() can fill it from simulate's own --config file.
    sim.set_defaults(func=cmd_simulate, sim_parser=sim)
    return parser, serve


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    parser, serve = build_parsers()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        # The file's values become serve's defaults; parsing again lets the command line win.
        apply_config_file(serve, args.config)
        args = parser.parse_args(argv)
    if getattr(args, "sim_config", None):
        apply_config_file(args.sim_parser, args.sim_config)
        args = parser.parse_args(argv)
    try:
        args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
