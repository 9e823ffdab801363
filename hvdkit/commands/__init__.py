"""One module per ``hvdkit`` subcommand, each with ``register(subparsers)`` and a
``<name>_command(args) -> int``."""
