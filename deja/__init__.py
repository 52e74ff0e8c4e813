"""deja: the command line (the composition root)."""

__all__: list[str] = []  # the CLI is its entry point, deja.cli:main
