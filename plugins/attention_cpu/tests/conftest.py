"""Make the shared test helpers of this folder importable (the suite may run with --import-mode=importlib)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
