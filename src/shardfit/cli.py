"""The `shardfit` command: a thin shell. Each subcommand lives in shardfit/commands/<name>.py with
two functions, `add_arguments(parser)` and `run(args) -> int`; the logic lives in the stages.

Errors a user can fix (ShardfitError) print as one line and exit 2; nothing prints a traceback
unless SHARDFIT_DEBUG=1.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from shardfit.errors import ShardfitError

# name -> one-line help. Modules are imported only for the command that runs, so `plan` never
# pays for the imports of `train`.
COMMANDS = {
    "models": "list the shipped model presets",
    "plan": "memory per GPU by category and phase, for every strategy",
    "fit": "the cheapest configuration that fits, and why",
    "emit": "write a plan as DeepSpeed JSON, Accelerate YAML, FSDP code, launch commands",
    "doctor": "find the classic mistakes in existing training configs",
    "profile": "measure a real step by phase and category, and explain an OOM",
    "bench": "run the same step under each strategy, side by side",
    "calibrate": "measure this machine's rates into a device profile (--device-profile)",
    "train": "train a plan on DDP, FSDP, FSDP2 or DeepSpeed",
    "convert": "move a training checkpoint between engines (DeepSpeed <-> DCP)",
    "export": "consolidate a training checkpoint into a Hugging Face directory",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other user error
        raise ShardfitError(f"{message} (see `{self.prog} --help`)")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="shardfit", description="Training memory: plan, fit, emit, profile, bench, train.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, help_text in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == only:
            _module(name).add_arguments(command_parser)
    return parser


def _module(name: str):
    return importlib.import_module(f"shardfit.commands.{name.replace('-', '_')}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((arg for arg in argv if not arg.startswith("-")), None)
    try:
        if command not in COMMANDS:
            parser = build_parser()
            if command is None and not argv:
                parser.print_help()
                return 0
            if command is None:
                parser.parse_args(argv)
                return 0
            raise ShardfitError(f"unknown command '{command}': use one of {', '.join(COMMANDS)}")
        args, unknown = build_parser(only=command).parse_known_args(argv)
        if unknown:
            raise ShardfitError(f"unrecognized arguments: {' '.join(unknown)} (see `shardfit {command} --help`)")
        return int(_module(command).run(args) or 0)
    except ShardfitError as exc:
        if exc.every_rank and os.environ.get("RANK", "0") != "0":
            return 2  # rank 0 says it once
        # One line, whatever the message holds (a path with a newline or a carriage return in it).
        print(f"shardfit: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardfit: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # the file system said no (permissions, a name too long, a full disk): one line
        if os.environ.get("SHARDFIT_DEBUG"):
            raise
        where = f": {' '.join(str(exc.filename).split())[:200]}" if exc.filename else ""
        print(f"shardfit: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the last line of defence against tracebacks
        if os.environ.get("SHARDFIT_DEBUG"):
            raise
        print(f"shardfit: internal error: {type(exc).__name__}: {exc} (rerun with SHARDFIT_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1
