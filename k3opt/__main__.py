"""``python -m k3opt`` runs the ``k3opt`` command line."""
from .entry import main

main()
