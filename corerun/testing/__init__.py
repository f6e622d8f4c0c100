"""Test helpers for corerun and its plugins (public: a plugin's own tests may use them).

- :mod:`corerun.testing.tiny_models`: tiny random Hugging Face model folders (``make_tiny_model``) and
  corerun's logits on them without an engine; needs ``transformers`` (``pip install 'corerun[test]'``).
- :func:`corerun.testing.hf_greedy`: Hugging Face's greedy continuations, the reference an engine test
  compares corerun's tokens with.
- :func:`corerun.testing.requests_step`: a step's :class:`~corerun.protocols.graph.ModelInputs` (and
  its ``AttentionBatch``) from per-request context lengths, query lengths and block tables, the
  same builder the memory profile and the conformance suites use.
- :func:`corerun.testing.emulated_cuda_graph_runner` / :class:`EmulatedGraphCapturer`: corerun's
  ``cuda`` graph runner with CUDA-graph capture emulated on any device (a backend's
  ``cuda_graph_decode`` tested on CPU, e.g. with the graph-runner conformance suite).
- :func:`corerun.testing.default_model_dir`: the folder of corerun's default model (converted once).

For conformance, use :mod:`corerun.conformance` itself.
"""

from __future__ import annotations

from corerun.protocols.step_layout import requests_step
from corerun.testing.graphs import EmulatedGraphCapturer, emulated_cuda_graph_runner
from corerun.testing.reference import default_model_dir, hf_greedy

__all__ = ["EmulatedGraphCapturer", "default_model_dir", "emulated_cuda_graph_runner", "hf_greedy", "requests_step"]
