"""The command line imports a command's modules only when that command runs: ``widellm proxy``
(a light process in front of the engines) and ``widellm --help`` load no torch, no
transformers and no engine arguments (``proxy --help`` took 2.4 s and the proxy held 266 MB
with them; 0.1 s without)."""

from __future__ import annotations

from tests.import_check import modules_loaded_by

HEAVY = ("torch", "transformers", "widellm.engine.arg_utils")
CHECK = """
import contextlib, io
from widellm.entrypoints import cli
import widellm.kv_transfer.proxy_main  # what `widellm proxy` runs
for argv in (["--help"], ["proxy", "--help"], ["proxy", "--prefill", "http://p"]):
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()), \\
            contextlib.redirect_stderr(io.StringIO()):
        cli.main(argv)  # the last one is an argparse error: --decode is missing
"""


def test_proxy_and_top_level_help_import_no_engine():
    assert modules_loaded_by(CHECK, HEAVY) == []


def test_each_command_still_parses_its_own_flags():
    from widellm.entrypoints.cli import COMMANDS, build_parsers, command_of

    assert command_of(["-v"]) is None and command_of(["serve", "-h"]) == "serve"
    parser, _ = build_parsers(command_of(["proxy", "--prefill", "http://p", "--decode",
                                          "http://d"]))
    args = parser.parse_args(["proxy", "--prefill", "http://p", "--decode", "http://d"])
    assert (args.prefill, args.decode, args.func.__name__) == (["http://p"], ["http://d"],
                                                               "cmd_proxy")
    parser, _ = build_parsers("generate")
    args = parser.parse_args(["generate", "hi", "there", "--max-tokens", "3"])
    assert (args.prompt, args.max_tokens, args.func.__name__) == (["hi", "there"], 3,
                                                                  "cmd_generate")
    parser, _ = build_parsers("bench")
    assert parser.parse_args(["bench", "throughput"]).func.__name__ == "cmd_bench_throughput"
    assert [c.name for c in COMMANDS] == ["serve", "generate", "chat", "proxy", "bench",
                                          "simulate"]
