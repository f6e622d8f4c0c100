"""``KVCacheManagerSuite``: every KV-cache manager must pass it.

Bookkeeping only (no tensors): block accounting never leaks, exhaustion is reported (``None``,
state unchanged) not raised, prefix hits happen only on identical block-aligned token prefixes and
never cover the whole prompt, shared blocks are reference counted, and cached blocks are evicted
least recently freed first.  Sequences follow the protocol's order: ``get_computed_prefix`` on first
scheduling, ``allocate_slots`` before a step, ``cache_blocks`` after it, ``free`` at the end.
Protocol version 3: ``allocate_slots`` returns what a table gained since its last call (the claimed
prefix and any ``trim`` included), and the changes corerun's scheduler states from it replay, step
by step, to every scheduled sequence's ``block_table``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import pytest

from corerun.conformance.kv_cache_recording import ReturnedIds, Tokens
from corerun.conformance.suite import Case, ConformanceSuite
from corerun.core.scheduler import Scheduler
from corerun.core.sequence import Sequence as Seq
from corerun.sampling_params import SamplingParams
from corerun.conformance.target import Target

PREFIX_CHECKS = ("prefix_identical_only", "prefix_never_whole_prompt", "prefix_reference_counting", "eviction_order")


@dataclass(frozen=True)
class KVConfig:
    block_size: int
    prefix_caching: bool

    @property
    def id(self) -> str:
        # ("shared"/"private", not "prefix"/"noprefix": `-k prefix` then selects the prefix checks only)
        return f"bs{self.block_size}-{'shared' if self.prefix_caching else 'private'}"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManagerSuite(ConformanceSuite):
    """The KV-cache manager conformance suite.  Adopt it with::

        class TestMine(KVCacheManagerSuite):
            implementation = "mine"     # or factory = staticmethod(make); factory(num_blocks, block_size, *, prefix_caching)
    """

    kind = "kv_cache"

    def pick_device(self, target: Target) -> str:
        return "cpu"  # bookkeeping only

    def configs(self, check: str, target: Target, full: bool) -> list[tuple[str, Any]] | str:
        declared = bool(getattr(target.capabilities, "prefix_caching", True))
        modes = [True, False] if declared else [False]
        if check in PREFIX_CHECKS:
            if not declared:
                return f"{target.name} does not declare prefix caching"
            modes = [True]
        if check == "prefix_disabled":
            modes = [False]
        sizes = (1, 4, 16, 64) if full else (4, 16)
        return [(KVConfig(b, m).id, KVConfig(b, m)) for b in sizes for m in modes]

    # ------------------------------------------------------------------ helpers
    def _manager(self, case: Case, num_blocks: int) -> Any:
        cfg: KVConfig = case.config
        return case.target.create(num_blocks, cfg.block_size, prefix_caching=cfg.prefix_caching)

    @staticmethod
    def _table(m: Any, seq_id: int) -> list[int]:
        try:
            return list(m.block_table(seq_id))
        except LookupError:  # a sequence holding nothing may be unknown
            return []

    def _fail(self, case: Case, what: str, problem: str) -> None:
        pytest.fail(f"{what}: {problem}", pytrace=False)

    def _expect(self, case: Case, what: str, got: Any, want: Any, context: str) -> None:
        if got != want:
            self._fail(case, what, f"{context}: got {got!r}, expected {want!r}")

    def _admit(self, case: Case, m: Any, seq_id: int, tokens: Sequence[int], expect_hit: int | None = None) -> int:
        """First scheduling of a prompt: prefix lookup, allocation for all of it, then cache its full blocks."""
        hit = m.get_computed_prefix(seq_id, list(tokens))
        if expect_hit is not None:
            self._expect(case, "prefix lookup", hit, expect_hit, f"get_computed_prefix of a {len(tokens)}-token prompt")
        if m.allocate_slots(seq_id, len(tokens)) is None:
            self._fail(case, "allocation", f"allocate_slots({seq_id}, {len(tokens)}) failed with {m.num_free_blocks} free blocks")
        m.cache_blocks(seq_id, list(tokens), len(tokens))
        return hit

    def _probe(self, m: Any, seq_id: int, tokens: Sequence[int]) -> int:
        """Prefix length a new prompt would get; the probe sequence is freed again."""
        hit = m.get_computed_prefix(seq_id, list(tokens))
        m.free(seq_id)
        return hit

    # ------------------------------------------------------------------ checks
    def test_allocation_accounting(self, case: Case) -> None:
        """Tables grow block by block (never shrink), blocks are distinct and in range, frees return every block."""
        self.start(case)
        bs, n = case.config.block_size, 32
        m = self._manager(case, n)
        tok = Tokens(1)
        what = "accounting"
        self._expect(case, what, (m.num_blocks, m.block_size, m.num_free_blocks), (n, bs, n), "(num_blocks, block_size, num_free_blocks) of a new manager")
        self._expect(case, what, m.get_computed_prefix(1, tok(3 * bs + 1)), 0, "prefix of a prompt on an empty cache")
        steps = [(1, 1), (bs, 1), (bs + 1, 2), (1, 2), (3 * bs, 3)]
        first = None
        for tokens, blocks in steps:
            self._expect(case, what, m.allocate_slots(1, tokens) is not None, True, f"allocate_slots(1, {tokens}) with {m.num_free_blocks} free")
            table = self._table(m, 1)
            self._expect(case, what, len(table), blocks, f"block table length after allocate_slots(1, {tokens})")
            first = first if first is not None else table[0]
            self._expect(case, what, table[0], first, "first block after growing (tables only grow)")
            self._expect(case, what, m.num_free_blocks, n - blocks, f"num_free_blocks after allocate_slots(1, {tokens})")
        m.get_computed_prefix(2, tok(2 * bs))
        self._expect(case, what, m.allocate_slots(2, 2 * bs) is not None, True, "allocate_slots(2, 2 * block_size)")
        t1, t2 = self._table(m, 1), self._table(m, 2)
        if set(t1) & set(t2) or len(set(t1 + t2)) != len(t1 + t2) or not all(0 <= b < n for b in t1 + t2):
            self._fail(case, what, f"block tables overlap or leave [0, {n}): {t1} and {t2}")
        stats = m.stats()
        self._expect(case, what, (stats.num_blocks, stats.num_free_blocks), (n, n - 5), "stats() (num_blocks, num_free_blocks)")
        m.free(1)
        self._expect(case, what, m.num_free_blocks, n - 2, "num_free_blocks after freeing a 3-block sequence")
        m.free(2)
        self._expect(case, what, m.num_free_blocks, n, "num_free_blocks after freeing everything")

    def test_no_leak_random(self, case: Case) -> None:
        """300 random admit / grow / free operations: free count, table sizes and disjointness always add up."""
        self.start(case)
        bs, n = case.config.block_size, 24
        m = self._manager(case, n)
        tok, rng = Tokens(2), random.Random(3)
        live: dict[int, list[int]] = {}  # seq -> tokens it holds slots for
        next_id = 100
        for step in range(300):
            free_before = m.num_free_blocks
            op = rng.random()
            if op < 0.4 and len(live) < 6:
                tokens = tok(rng.randint(1, 4 * bs))
                seq, next_id = next_id, next_id + 1
                self._expect(case, "random ops", m.get_computed_prefix(seq, tokens), 0, f"step {step}: prefix of an unrelated prompt")
                ok, want = m.allocate_slots(seq, len(tokens)) is not None, _ceil(len(tokens), bs) <= free_before
                self._expect(case, "random ops", ok, want, f"step {step}: allocate_slots({seq}, {len(tokens)}) with {free_before} free blocks")
                if ok:
                    live[seq] = tokens
                else:
                    m.free(seq)
            elif op < 0.75 and live:
                seq = rng.choice(sorted(live))
                old = live[seq]
                if case.config.prefix_caching:
                    m.cache_blocks(seq, old, len(old))
                new = old + tok(rng.randint(1, 2 * bs))
                table_before = self._table(m, seq)
                ok = m.allocate_slots(seq, len(new)) is not None
                want = _ceil(len(new), bs) - _ceil(len(old), bs) <= free_before
                self._expect(case, "random ops", ok, want, f"step {step}: growing seq {seq} to {len(new)} tokens with {free_before} free blocks")
                if ok:
                    live[seq] = new
                else:
                    self._expect(case, "random ops", self._table(m, seq), table_before, f"step {step}: table after a refused growth")
            elif live:
                seq = rng.choice(sorted(live))
                m.free(seq)
                del live[seq]
            held = {s: self._table(m, s) for s in live}
            for s, table in held.items():
                self._expect(case, "random ops", len(table), _ceil(len(live[s]), bs), f"step {step}: table length of seq {s} holding {len(live[s])} tokens")
            every = [b for t in held.values() for b in t]
            if len(set(every)) != len(every) or not all(0 <= b < n for b in every):
                self._fail(case, "random ops", f"step {step}: live tables share blocks or leave [0, {n}): {held}")
            self._expect(case, "random ops", m.num_free_blocks, n - len(every), f"step {step}: num_free_blocks with {len(every)} blocks held")
        for seq in list(live):
            m.free(seq)
        self._expect(case, "random ops", m.num_free_blocks, n, "num_free_blocks after freeing every sequence (a leak otherwise)")

    def test_block_tables_only_grow(self, case: Case) -> None:
        """While a sequence holds blocks its table only grows at the end (the runner keeps tables across
        steps and reads only what is new); after free and re-admission under the same seq_id it is a new
        table, read fresh, disjoint from the live ones."""
        self.start(case)
        bs, n = case.config.block_size, 64
        m = self._manager(case, n)
        tok, rng = Tokens(10), random.Random(11)
        what = "tables only grow"
        tokens = {seq: tok(rng.randint(1, 2 * bs)) for seq in (1, 2, 3)}
        held: dict[int, list[int]] = {}  # seq -> its table as last read
        for seq, prompt in tokens.items():
            self._admit(case, m, seq, prompt)
            held[seq] = self._table(m, seq)
        for step in range(24):
            seq = rng.choice(sorted(held))
            if step % 8 == 7:  # preempted and back: the same tokens, recomputed into a new table
                m.free(seq)
                del held[seq]
                self._admit(case, m, seq, tokens[seq])
                table = self._table(m, seq)
                self._expect(case, what, len(table), _ceil(len(tokens[seq]), bs), f"step {step}: table length of re-admitted seq {seq} holding {len(tokens[seq])} tokens")
                live = {b for t in held.values() for b in t}
                if set(table) & live:
                    self._fail(case, what, f"step {step}: re-admitted seq {seq}'s table {table} shares blocks with live tables {held}")
                held[seq] = table
                continue
            grown = tokens[seq] + tok(rng.choice((1, 1, max(bs - 1, 1), bs, bs + 1)))
            if case.config.prefix_caching:
                m.cache_blocks(seq, tokens[seq], len(tokens[seq]))
            if m.allocate_slots(seq, len(grown)) is not None:
                tokens[seq] = grown
            for s in sorted(held):  # every live table, not only the grown one
                table = self._table(m, s)
                if table[: len(held[s])] != held[s]:
                    self._fail(case, what, f"step {step}: seq {s}'s table was {held[s]} and is now {table} after growing seq {seq} to "
                               f"{len(tokens[seq])} tokens; entries handed out must not change while the sequence holds blocks")
                self._expect(case, what, len(table), _ceil(len(tokens[s]), bs), f"step {step}: table length of seq {s} holding {len(tokens[s])} tokens")
                held[s] = table
        for seq in held:
            m.free(seq)
        self._expect(case, what, m.num_free_blocks, n, "num_free_blocks after freeing every sequence")

    def test_new_block_ids(self, case: Case) -> None:
        """``allocate_slots`` returns ``block_table(seq_id)[start:]``, ``start`` the table's length when it
        last returned (0 on a sequence's first call, the claimed prefix included; lowered by a ``trim``);
        a ``trim`` (optional) returns the length kept; and corerun's scheduler, running 80 steps over the manager (chunked prefills,
        decodes, speculative drafts trimmed back, preemption by recompute, prefix hits, finishing),
        states changes (``ScheduledBatch.new_block_ids``: new requests' whole tables, the others'
        changes; ``finished_ids``) whose replay equals the
        ``block_table`` of every scheduled sequence at every step."""
        self.start(case)
        bs = case.config.block_size
        checked = ReturnedIds(self._manager(case, 14))  # room for two or three sequences: preemptions
        m = checked.inner
        rng, tok = random.Random(21), Tokens(22)
        what = "stated changes"
        drafting = [0]

        def propose() -> dict[int, list[int]]:  # drafts on every third decode, all rejected below
            out = {}
            for seq in sched.running:
                if seq.num_tokens - seq.num_computed_tokens == 1:
                    drafting[0] += 1
                    if drafting[0] % 3 == 0:
                        out[seq.seq_id] = tok(bs + 1)
            return out

        sched = Scheduler(checked, max_num_seqs=6, max_num_batched_tokens=3 * bs + 8)
        shared = tok(2 * bs)  # a prefix several prompts start with (prefix hits when the manager shares)
        seqs: dict[int, Any] = {}
        mirror: dict[int, list[int]] = {}  # seq_id -> its table, from the stated changes only
        trims = 0
        for step in range(80):
            while len(sched) < 8 and rng.random() < 0.5:
                sid = len(seqs) + 1
                prompt = (shared if rng.random() < 0.5 else []) + tok(rng.randint(1, 3 * bs))
                seqs[sid] = Seq(sid, str(sid), prompt, SamplingParams(max_tokens=64))
                sched.add(seqs[sid])
            sched.update_draft_token_ids(propose())
            batch = sched.schedule()
            if checked.problem:
                self._fail(case, what, f"step {step}: {checked.problem}")
            scheduled = [s for s in sched.seqs_of(batch) if s is not None]
            for sid in batch.finished_ids:
                mirror.pop(sid, None)
            for sid, change in batch.new_block_ids.items():
                if change.start > len(mirror.get(sid, [])):
                    self._fail(case, what, f"step {step}: seq {sid}'s change starts at {change.start}, past its "
                               f"{len(mirror.get(sid, []))} blocks stated so far")
                mirror[sid] = change.apply(mirror.get(sid, []))
            for seq in scheduled:
                table = self._table(m, seq.seq_id)
                if mirror.get(seq.seq_id) != table:
                    self._fail(case, what, f"step {step}: seq {seq.seq_id}'s table is {table}, but the changes stated "
                               f"from allocate_slots' ids replay to {mirror.get(seq.seq_id)}")
            for seq, n in zip(scheduled, batch.num_scheduled):  # the step ran: drafts all rejected
                n -= len(batch.drafts.get(seq.seq_id, ()))
                seq.num_computed_tokens += n
                m.cache_blocks(seq.seq_id, list(seq.token_ids), seq.num_computed_tokens)
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.token_ids.append(tok(1)[0])
                    if seq.num_tokens - seq.num_prompt_tokens >= rng.randint(3, 4 * bs):
                        sched.finish(seq, "length")
                        continue
                if seq.seq_id in batch.drafts and hasattr(m, "trim"):
                    sched.trim(seq, seq.num_tokens)
                    if checked.problem:
                        self._fail(case, what, f"step {step}: {checked.problem}")
                    kept = len(self._table(m, seq.seq_id))
                    trims += 1
                    self._expect(case, what, kept >= _ceil(seq.num_tokens, bs), True,
                                 f"step {step}: trim({seq.seq_id}, {seq.num_tokens}) kept {kept} blocks of {bs}")
        if sched.num_preemptions == 0 or (hasattr(m, "trim") and trims == 0):
            raise RuntimeError(f"suite input: {sched.num_preemptions} preemptions and {trims} trims in the run")

    def test_exhaustion(self, case: Case) -> None:
        """Running out of blocks returns None and changes nothing; freeing makes room again."""
        self.start(case)
        bs, n = case.config.block_size, 8
        m = self._manager(case, n)
        tok = Tokens(4)
        what = "exhaustion"
        self._admit(case, m, 1, tok(5 * bs))
        m.get_computed_prefix(2, tok(4 * bs))
        snapshot = (m.num_free_blocks, self._table(m, 1), self._table(m, 2), m.stats())
        try:
            refused = [m.allocate_slots(2, 4 * bs), m.allocate_slots(1, 8 * bs + 1)]
        except Exception as exc:
            self._fail(case, what, f"allocate_slots raised {type(exc).__name__} ({exc}) when blocks ran out; it must return None")
        self._expect(case, what, refused, [None, None], "allocate_slots needing 4 blocks with 3 free (new seq, growing seq)")
        after = (m.num_free_blocks, self._table(m, 1), self._table(m, 2), m.stats())
        self._expect(case, what, after, snapshot, "(num_free_blocks, tables, stats) after refused allocations")
        self._expect(case, what, m.allocate_slots(2, 3 * bs) is not None, True, "allocate_slots of exactly the 3 free blocks")
        self._expect(case, what, (m.num_free_blocks, m.allocate_slots(1, 5 * bs + 1)), (0, None), "(free, allocate one more block) when full")
        m.free(2)
        self._expect(case, what, m.allocate_slots(1, 5 * bs + 1) is not None, True, "allocate_slots after freeing a sequence")
        m.free(1)
        self._expect(case, what, m.num_free_blocks, n, "num_free_blocks after freeing everything")

    def test_prefix_identical_only(self, case: Case) -> None:
        """Hits only on identical block-aligned prefixes (hashes chain: the same block after a different one misses)."""
        self.start(case)
        bs = case.config.block_size
        m = self._manager(case, 40)
        tok = Tokens(5)
        a = tok(3 * bs + 2)
        self._admit(case, m, 1, a, expect_hit=0)
        hits_before = m.stats().prefix_hits
        b = a[: 2 * bs] + tok(bs + 2)
        self._expect(case, "prefix", m.get_computed_prefix(2, b), 2 * bs, "prompt sharing the first two blocks")
        self._expect(case, "prefix", m.allocate_slots(2, len(b)) is not None, True, f"allocate_slots(2, {len(b)}) with {m.num_free_blocks} free blocks")
        self._expect(case, "prefix", m.stats().prefix_hits - hits_before, 2 * bs, "stats().prefix_hits increase once admitted")
        ta, tb = self._table(m, 1), self._table(m, 2)
        if tb[:2] != ta[:2] or set(tb[2:]) & set(ta):
            self._fail(case, "prefix", f"the sharing prompt's table {tb} must start with {ta[:2]} and otherwise avoid {ta}")
        probes = [
            ("differs in its first token", [a[0] + 1] + a[1:], 0),
            ("has the same second block after a different first block", tok(bs) + a[bs : 2 * bs] + tok(3), 0),
            ("differs in the middle of its second block", a[: bs + bs // 2] + [a[bs + bs // 2] + 1] + a[bs + bs // 2 + 1 :], bs),
            # (ends inside block 3; with block size 1 the last token is block 3 itself, recomputed)
            ("is a shorter prefix ending inside block 3", a[: 2 * bs + min(3, max(bs - 1, 1))], 2 * bs),
            ("is shorter than one block", a[: max(bs - 1, 1)], 0),
        ]
        for i, (desc, prompt, want) in enumerate(probes):
            self._expect(case, "prefix", self._probe(m, 10 + i, prompt), want, f"a prompt that {desc}")
        m.free(1)
        m.free(2)

    def test_prefix_never_whole_prompt(self, case: Case) -> None:
        """The last prompt token is always recomputed, so a fully cached prompt hits one block less."""
        self.start(case)
        bs = case.config.block_size
        m = self._manager(case, 16)
        a = Tokens(6)(2 * bs)
        self._admit(case, m, 1, a, expect_hit=0)
        probes = [("the whole cached prompt", a, bs), ("the cached prompt plus one token", a + [7], 2 * bs),
                  ("exactly its first block", a[:bs], 0), ("its first block plus one token", a[: bs + 1], bs)]
        for i, (desc, prompt, want) in enumerate(probes):
            self._expect(case, "whole prompt", self._probe(m, 10 + i, prompt), want, f"prefix of {desc} ({len(prompt)} tokens)")
        m.free(1)

    def test_prefix_reference_counting(self, case: Case) -> None:
        """Blocks shared by two sequences survive one free, are never handed out while in use, and claiming
        an evictable cached block takes it off the free count."""
        self.start(case)
        bs, n = case.config.block_size, 10
        m = self._manager(case, n)
        tok = Tokens(7)
        what = "reference counting"
        a = tok(3 * bs + 1)
        self._admit(case, m, 1, a, expect_hit=0)  # 4 blocks
        b = a[: 2 * bs] + tok(bs)
        self._admit(case, m, 2, b, expect_hit=2 * bs)  # shares 2, adds 1
        self._expect(case, what, m.num_free_blocks, n - 5, "num_free_blocks with two sequences sharing 2 blocks")
        shared = self._table(m, 2)
        m.free(1)
        self._expect(case, what, m.num_free_blocks, n - 3, "num_free_blocks after freeing one of the sharers")
        x = tok(7 * bs)
        self._admit(case, m, 3, x, expect_hit=0)
        if set(self._table(m, 3)) & set(shared):
            self._fail(case, what, f"blocks {sorted(set(self._table(m, 3)) & set(shared))} were handed out while seq 2 still uses them")
        self._expect(case, what, self._table(m, 2), shared, "table of the surviving sharer")
        m.get_computed_prefix(4, tok(1))
        self._expect(case, what, m.allocate_slots(4, 1), None, "allocate_slots with no free block left")
        m.free(4)
        m.free(3)
        self._expect(case, what, self._probe(m, 5, a[: 2 * bs] + [1]), 2 * bs, "prefix of the shared blocks while seq 2 holds them")
        m.free(2)
        self._expect(case, what, m.num_free_blocks, n, "num_free_blocks after freeing everything")
        hit = m.get_computed_prefix(6, a[: 2 * bs] + [1])
        self._expect(case, what, (hit, m.num_free_blocks), (2 * bs, n - 2), "(prefix, num_free_blocks) after claiming 2 evictable cached blocks")
        self._expect(case, what, m.allocate_slots(6, 2 * bs + 1) is not None, True, "allocate_slots after a claim")
        self._expect(case, what, m.num_free_blocks, n - 3, "num_free_blocks after growing past the claimed blocks")
        m.free(6)
        self._expect(case, what, m.num_free_blocks, n, "num_free_blocks after freeing everything")

    def test_eviction_order(self, case: Case) -> None:
        """When free blocks run out, cached blocks are reused least recently freed first."""
        self.start(case)
        bs = case.config.block_size
        m = self._manager(case, 3)
        tok = Tokens(8)
        prompts = {name: tok(bs) for name in "XYZ"}
        for i, name in enumerate("XYZ"):
            self._admit(case, m, i + 1, prompts[name], expect_hit=0)
        for i in range(3):
            m.free(i + 1)  # X, then Y, then Z
        self._admit(case, m, 10, tok(bs), expect_hit=0)
        self._expect(case, "eviction", self._probe(m, 20, prompts["X"] + [1]), 0, "prefix of X's block after one allocation (X was freed first)")
        self._admit(case, m, 11, tok(bs), expect_hit=0)
        y, z = self._probe(m, 30, prompts["Y"] + [1]), self._probe(m, 31, prompts["Z"] + [1])
        self._expect(case, "eviction", {"Y": y, "Z": z}, {"Y": 0, "Z": bs}, "prefix of Y's and Z's blocks after a second allocation")
        m.free(10)
        m.free(11)

    def test_prefix_disabled(self, case: Case) -> None:
        """With ``prefix_caching=False`` nothing is ever shared."""
        self.start(case)
        bs = case.config.block_size
        m = self._manager(case, 16)
        a = Tokens(9)(3 * bs + 1)
        self._admit(case, m, 1, a, expect_hit=0)
        self._admit(case, m, 2, a, expect_hit=0)
        if set(self._table(m, 1)) & set(self._table(m, 2)):
            self._fail(case, "prefix caching off", f"identical prompts share blocks: {self._table(m, 1)} and {self._table(m, 2)}")
        m.free(1)
        m.free(2)
        self._expect(case, "prefix caching off", m.num_free_blocks, 16, "num_free_blocks after freeing everything")
