"""The speculative-decoding policy: which requests get drafts, how many, and what was accepted.

After each step the engine hands the running requests to :meth:`SpecDecoder.propose`; the drafts go
to the scheduler, which verifies them when each request is next scheduled as a decode.  A request
gets no drafts when it asks for logprobs or uses a logits processor (one row per step), never more
than its length limit leaves, and at most its adaptive cap: one past what was accepted after a
rejection, doubling while all are accepted (text that does not repeat itself pays for one draft
token a step, not ``num_tokens``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from corerun.core.batch import ScheduledBatch, StepResult
from corerun.core.sequence import Sequence
from corerun.sampling_params import SamplingParams
from corerun.spec_decode.proposer import Proposer
from corerun.spec_decode.verify import SpecStats


class SpecDecoder:
    """``proposer``'s drafts under the policy above; ``one_row(params)``: the request needs one logits
    row per step (a logits processor).  ``enabled`` off: no drafts (``LLMEngine.set_speculative``)."""

    def __init__(self, proposer: Proposer, *, max_model_len: int, one_row: Callable[[SamplingParams], bool]) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.one_row = one_row
        self.enabled = True
        self.stats = SpecStats()  # acceptance counts since the engine started
        self._cap: dict[int, int] = {}  # seq_id -> drafts it may get next (below num_tokens after rejections)

    def room(self, seq: Sequence) -> int:
        """How many drafts ``seq``'s next decode may carry."""
        p = seq.params
        if p.logprobs is not None or self.one_row(p):
            return 0
        room = min(seq.tokens_left(self.max_model_len) - 1, self.proposer.num_tokens)
        return min(room, self._cap.get(seq.seq_id, room))

    def propose(self, running: Iterable[Sequence]) -> dict[int, list[int]]:
        """Drafts for each of ``running`` whose next step is a decode (seq_id -> tokens)."""
        if not self.enabled:
            return {}
        wanted = []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                k = self.room(seq)
                if k > 0:
                    wanted.append((seq.seq_id, seq.token_ids, k))
        return self.proposer.propose(wanted) if wanted else {}

    def record(self, batch: ScheduledBatch, result: StepResult) -> None:
        """Count what ``batch``'s drafts got accepted, and set each request's next cap from it."""
        if not batch.drafts:
            return
        st, k = self.stats, self.proposer.num_tokens
        for j, row in enumerate(result.rows):
            sid = batch.req_ids[row]
            d = batch.drafts.get(sid)
            if not d:
                continue
            accepted = len(result.emitted(j)) - 1
            st.num_drafts, st.num_draft_tokens = st.num_drafts + 1, st.num_draft_tokens + len(d)
            st.num_accepted_tokens += accepted
            grown = min(k, max(2 * len(d), self._cap.get(sid, k)))
            self._cap[sid] = grown if accepted >= len(d) else accepted + 1

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget requests that finished, were aborted or preempted."""
        for sid in seq_ids:
            self._cap.pop(sid, None)
            self.proposer.release(sid)

    def shutdown(self) -> None:
        """Free the draft model's cache and graphs, if there is one."""
        runner: Any = self.proposer.runner
        if runner is not None and hasattr(runner, "shutdown"):
            runner.shutdown()
