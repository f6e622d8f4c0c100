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
- :func:`corerun.testing.make_llm`: a :class:`corerun.LLM` on a tiny model (or yours) with test
  defaults (CPU, float32, torch attention, 64 KV blocks of 4 tokens), any of them overridable by keyword.
- :func:`corerun.testing.assert_idle`: the engine holds no request (running, waiting or unreleased), no
  step in flight and no used KV block; the failure lists what is left.
- :func:`corerun.testing.tiny_models.load_corerun_model`: corerun's model from a folder or a ``.gguf`` file, a
  quantization method applied, with no engine (a method's layers tested against float64).
- :func:`corerun.testing.openmp_runtimes`: the OpenMP runtime files mapped into this process (a
  kernel library's tests check that it brought no second one).
- :func:`corerun.testing.max_rel_err` / :func:`corerun.testing.assert_rel_err`: ``max |got - ref| /
  max |ref|`` in float64, and the assertion naming the error, the bound and the worst entry.

For conformance, use :mod:`corerun.conformance` itself.
"""

from __future__ import annotations

from corerun.platform.host import openmp_runtimes
from corerun.protocols.step_layout import requests_step
from corerun.testing.engines import TEST_DEFAULTS, assert_idle, leftovers, make_llm
from corerun.testing.graphs import EmulatedGraphCapturer, emulated_cuda_graph_runner
from corerun.testing.numerics import assert_rel_err, max_rel_err
from corerun.testing.reference import default_model_dir, hf_greedy

__all__ = [
    "TEST_DEFAULTS", "EmulatedGraphCapturer", "assert_idle", "assert_rel_err", "default_model_dir",
    "emulated_cuda_graph_runner", "hf_greedy", "leftovers", "make_llm", "max_rel_err", "openmp_runtimes",
    "requests_step",
]
