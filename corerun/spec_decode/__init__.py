"""Speculative decoding: n-gram and draft-model proposals and their verification (docs/speculative-decoding.md).

- :mod:`corerun.spec_decode.ngram`: prompt lookup, the draft tokens that follow the latest earlier
  occurrence of the request's last n tokens.
- :mod:`corerun.spec_decode.draft_model`: a smaller model of the same vocabulary, run greedily ahead.
- :mod:`corerun.spec_decode.verify`: one sampling row per verified position, each with the history it
  would have had without speculation, and the accepted prefix of the drafts.
- :mod:`corerun.spec_decode.proposer`: :class:`Proposer`, what the engine asks of either proposer.
- :mod:`corerun.spec_decode.policy`: :class:`SpecDecoder`, which requests get how many drafts, and
  the acceptance counts.
"""

from corerun.spec_decode.draft_model import DraftModelProposer
from corerun.spec_decode.ngram import NgramProposer
from corerun.spec_decode.policy import SpecDecoder
from corerun.spec_decode.proposer import Proposer
from corerun.spec_decode.verify import SpecStats, accept_drafts, expand_metadata

__all__ = ["DraftModelProposer", "NgramProposer", "Proposer", "SpecDecoder", "SpecStats", "accept_drafts", "expand_metadata"]
