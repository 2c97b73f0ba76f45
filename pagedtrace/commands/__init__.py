"""One module per ``pagedtrace`` subcommand: ``add_parser(subparsers)`` and ``run(args, console) -> int``."""
