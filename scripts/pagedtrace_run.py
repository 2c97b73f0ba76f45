"""``pagedtrace run`` alone: for a host without libcst (the CLI builds every subcommand's parser)."""

import argparse
import sys

from rich.console import Console

from pagedtrace.cli import UsageError
from pagedtrace.commands import run as run_command


def main() -> int:
    parser = argparse.ArgumentParser(prog="pagedtrace")
    run_command.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(sys.argv[1:])
    try:
        return args.func(args, Console())
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # vLLM's engine core process (``--multiprocess``) imports this module again
    sys.exit(main())
