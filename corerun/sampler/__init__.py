"""The built-in ``full`` sampler (vLLM v1's pipeline: penalties, top-k, top-p, min-p, logprobs, seeds).

``full.py`` holds :class:`~corerun.sampler.full.FullSampler`; ``options.py`` what it declares to the
registry (imported without torch by :mod:`corerun.plugin.builtin`).  The stages live one per module:
``processors.py`` (logit bias, min_tokens), ``penalties.py`` (with ``histories.py``),
``truncation.py`` (min-p, top-k, top-p), ``logprobs.py``.
"""
