"""``python -m k3opt`` runs the ``k3opt`` command line."""
from .cli import main

main(prog_name="k3opt")
