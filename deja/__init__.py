"""deja: the command line (the composition root)."""
