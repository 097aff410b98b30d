"""``python -m semzo``: see :mod:`semzo.cli`."""

from .cli import main

main()
