"""`python -m llminfer.bench <what>`: the one entry point of the benchmarks, a subcommand each. Chapter 04.

Every subcommand measures through the same layer (`measure`: contenders taking turns, threads, ceilings) and
writes through the same report (`report`: the machine, the load, JSON + table + plot).
"""
from __future__ import annotations

import argparse
import sys

from ..checks import HelpFormatter
from . import decode, decode_real, engine, gpu_check, llama_peer, moe, prefill_decode, rows, serve, structured

__all__ = ["SUBCOMMANDS", "parser", "main"]

# name -> the module that adds its options (add_arguments), runs it (command) and says what it does (SUMMARY)
SUBCOMMANDS = {"prefill-decode": prefill_decode, "decode": decode, "real": decode_real, "engine": engine,
               "serve": serve, "gpu": gpu_check, "rows": rows, "llama-cpp": llama_peer, "moe": moe,
               "structured": structured}


class _Help(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """Each option's default shown once (a switch's none: its help says what it turns on or off); a subcommand's
    description kept as written."""

    def _get_help_string(self, action):
        return action.help or "" if action.nargs == 0 else super()._get_help_string(action)


def parser() -> argparse.ArgumentParser:
    """Returns the command line's parser: one subparser per benchmark. Chapter 04."""
    top = argparse.ArgumentParser(prog="python -m llminfer.bench", description=__doc__.split("\n")[0],
                                  formatter_class=_Help)
    subcommands = top.add_subparsers(dest="what", metavar="<what>", required=True)
    for name, module in SUBCOMMANDS.items():
        sub = subcommands.add_parser(name, help=module.SUMMARY, description=module.__doc__, formatter_class=_Help)
        module.add_arguments(sub)
        sub.set_defaults(command=module.command, parser=sub)
    return top


def main(argv: list[str] | None = None) -> int:
    """Runs `python -m llminfer.bench <what> [options]`; returns its exit status. Chapter 04."""
    args = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    return args.command(args, args.parser)
