"""``widellm`` command line: serve, generate, chat, proxy, bench, simulate (also ``python -m
widellm``).

Each command's flags are added, and its modules imported, only when that command runs (or its
help is asked for): ``widellm proxy`` imports no torch and no transformers (a light process in
front of the engines), and ``widellm --help`` answers at once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NamedTuple

from widellm.entrypoints.config_file import apply_config_file

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
    from widellm.engine.arg_utils import EngineArgs

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    for out in llm.generate(args.prompt, _sampling_params(args), use_tqdm=False):
        print(out.outputs[0].text)


def cmd_chat(args: argparse.Namespace) -> None:
    from widellm.engine.arg_utils import EngineArgs
    from widellm.entrypoints.chat import run_chat

    run_chat(EngineArgs.from_cli_args(args), _sampling_params(args), args.message)


def cmd_serve(args: argparse.Namespace) -> None:
    if args.headless:
        from widellm.engine.arg_utils import EngineArgs
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


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    from widellm.engine.arg_utils import EngineArgs
    from widellm.entrypoints.server_args import add_server_cli_args

    EngineArgs.add_cli_args(serve, positional_model=True)
    add_server_cli_args(serve)


def _add_offline_args(with_prompt: Callable[[argparse.ArgumentParser], None]):
    def add(parser: argparse.ArgumentParser) -> None:
        from widellm.engine.arg_utils import EngineArgs

        with_prompt(parser)
        _sampling_args(parser)
        EngineArgs.add_cli_args(parser)

    return add


def add_proxy_args(proxy: argparse.ArgumentParser) -> None:
    from widellm.kv_transfer.proxy_routing import add_proxy_cli_args

    add_proxy_cli_args(proxy)


def add_bench_args(bench: argparse.ArgumentParser) -> None:
    from widellm.bench.serve_args import add_cli_args as add_serve_args
    from widellm.bench.throughput import add_cli_args

    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput on random prompts")
    add_cli_args(tp)
    tp.set_defaults(func=cmd_bench_throughput)
    sv = bench_sub.add_parser("serve", help="load an OpenAI-compatible server over HTTP")
    add_serve_args(sv)
    sv.set_defaults(func=cmd_bench_serve)


def add_simulate_args(sim: argparse.ArgumentParser) -> None:
    from widellm.sim.cli import add_cli_args

    add_cli_args(sim)
    # The parser rides along so main() can fill it from simulate's own --config file.
    sim.set_defaults(func=cmd_simulate, sim_parser=sim)


class Command(NamedTuple):
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]  # imports what the command needs
    run: Callable[[argparse.Namespace], None] | None  # None: set by its subcommands


COMMANDS = (
    Command("serve", "OpenAI-compatible HTTP server", add_serve_args, cmd_serve),
    Command("generate", "complete one or more prompts",
            _add_offline_args(lambda p: p.add_argument("prompt", nargs="+")), cmd_generate),
    Command("chat", "chat in the terminal (one turn if MESSAGE is given)",
            _add_offline_args(lambda p: p.add_argument("message", nargs="?", default=None)),
            cmd_chat),
    Command("proxy", "OpenAI-compatible front over disaggregated prefill and decode instances",
            add_proxy_args, cmd_proxy),
    Command("bench", "benchmarks", add_bench_args, None),
    Command("simulate", "simulate a wide-EP deployment in virtual time", add_simulate_args,
            None),
)


def command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (the top level takes no option with a value, so it is the
    first word that is not an option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser() -> argparse.ArgumentParser:
    return build_parsers()[0]


def build_parsers(only: str | None = None
                  ) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The ``widellm`` parser and its ``serve`` subparser (which --config fills). Every
    command's flags, or with ``only`` just that command's (the others are listed, empty)."""
    parser = argparse.ArgumentParser(prog="widellm")
    parser.add_argument("-v", "--version", action="version", version=package_version())
    sub = parser.add_subparsers(dest="command", required=True)
    built = {}
    for command in COMMANDS:
        built[command.name] = sub.add_parser(command.name, help=command.help)
        if only is None or only == command.name:
            command.add_args(built[command.name])
        if command.run is not None:
            built[command.name].set_defaults(func=command.run)
    return parser, built["serve"]


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, "INFO"),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, serve = build_parsers(command_of(argv) or "")
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
