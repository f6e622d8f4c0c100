"""Run the kernels in Triton's interpreter on CPU, and make the shared test helpers importable.

``TRITON_INTERPRET`` must be set before triton decorates any kernel, so before any test module
imports the plugin's kernels.  If an earlier part of the same session already built them compiled
for CUDA, the mode cannot change any more: the tests then skip and say so.
"""

import os
import sys
from pathlib import Path

import pytest

os.environ["TRITON_INTERPRET"] = "1"

# The suite may run with --import-mode=importlib, which puts no test folder on sys.path.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _interpreted_kernels():
    from corerun_attention_triton.kernels import INTERPRET

    if not INTERPRET:
        pytest.skip("the Triton kernels were built compiled for CUDA earlier in this session; "
                    "run plugins/attention_triton/tests in a session of their own")
