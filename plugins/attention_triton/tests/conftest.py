"""Run the kernels in Triton's interpreter, and make the shared test helpers importable.

``TRITON_INTERPRET`` must be set before triton decorates any kernel, so before any test module
imports the plugin; ``setdefault`` leaves a value the caller chose (``TRITON_INTERPRET=0`` on a GPU).
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite may run with --import-mode=importlib, which puts no test folder on sys.path.
sys.path.insert(0, str(Path(__file__).parent))
