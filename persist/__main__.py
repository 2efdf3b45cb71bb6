"""``python -m persist``: the same as the ``persist`` command."""

from .cli import main

main()
