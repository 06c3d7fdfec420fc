"""Let the tests import k3opt_gelu from the source tree when the package is not pip-installed."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
