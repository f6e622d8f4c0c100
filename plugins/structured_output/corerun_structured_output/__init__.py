"""corerun-structured-output: the ``xgrammar`` logits processor (``SamplingParams.structured_outputs``)."""
