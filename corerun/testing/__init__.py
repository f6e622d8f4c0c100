"""Test helpers for corerun and its plugins (public: a plugin's own tests may use them).

- :mod:`corerun.testing.tiny_models`: tiny random Hugging Face model folders (``make_tiny_model``) and
  corerun's logits on them without an engine; needs ``transformers`` (``pip install 'corerun[test]'``).
- :func:`corerun.testing.hf_greedy`: Hugging Face's greedy continuations, the reference an engine test
  compares corerun's tokens with.

For conformance, use :mod:`corerun.conformance` itself.
"""

from __future__ import annotations

from corerun.testing.reference import hf_greedy

__all__ = ["hf_greedy"]
