"""``python -m corerun`` runs the command line."""

from corerun.cli import main

main()
