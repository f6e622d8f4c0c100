"""``n > 1`` (samples forked after one prefill, sharing its blocks) and stop strings, in the engine itself.

References: a brute-force search for the stop-string helpers; for ``n``, the same request with
``n=1`` and ``seed + i`` (vLLM's seeding of the samples), and the KV manager's own prefix counters.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

import pytest

from corerun import LLM, SamplingParams
from corerun.engine.stop_strings import final_text, find_stop, partial_stop_len, running_text
from corerun.errors import RequestError
from corerun.testing import assert_idle
from tests.helpers.engine_testing import no_hang  # noqa: F401
from tests.helpers.serving import ENGINE, tiny_chat_model
from tests.helpers.tiny_models import make_tiny_model

PROMPT = "the cat sat on the mat and the dog sat on the log"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = LLM(str(tiny_chat_model(tmp_path_factory.mktemp("nstop"))), **ENGINE,
              kv_cache={"num_blocks": 96, "block_size": 4})
    yield llm
    llm.shutdown()


# ------------------------------------------------------------ helpers
def _brute_first(text: str, stops: list[str]) -> tuple[int, str] | None:
    hits = [(i, -len(s), s) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    return (min(hits)[0], min(hits)[2]) if hits else None


def test_stop_helpers_against_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab c") for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        first = _brute_first(text, stops)
        assert find_stop(text, stops) == first
        start = rng.randint(0, len(text))  # occurrences ending at or after start only
        late = [(i, -len(s), s) for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > start]
        got = find_stop(text, stops, start)
        assert (got[0] if got else None) == (min(late)[0] if late else None)
        hold = partial_stop_len(text, stops)
        assert hold == max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)
        assert running_text(text, stops, include=False) == text[: len(text) - hold]
        assert running_text(text, stops, include=True) == text
        if got is not None:  # the engine stopped on got[1]: the final text ends before it (or after, included)
            s = got[1]
            i = min(i for i in range(len(text)) if text.startswith(s, i) and i + len(s) > start)
            assert final_text(text, s, start, include=False) == text[:i]
            assert final_text(text, s, start, include=True) == text[: i + len(s)]


# ------------------------------------------------------------ stop strings
def _greedy(llm: LLM, max_tokens: int = 24, **kw: Any) -> Any:
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0]


def test_stop_string_streamed_shows_only_prefixes_of_the_result(llm: LLM) -> None:
    full = _greedy(llm)
    tok = llm.get_tokenizer()
    ends = [len(tok.decode(full.token_ids[: i + 1])) for i in range(len(full.token_ids))]
    # a stop string straddling the boundary after token 4: the last char of it and the first of the next
    b = ends[4]
    stop = full.text[b - 1 : b + 1]
    expect = full.text[: full.text.index(stop)]
    texts = [o.outputs[0].text for o in llm.stream([PROMPT], SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, stop=stop))]
    assert texts[-1] == expect
    assert all(expect.startswith(t) for t in texts)  # never a character that the stop string later removed
    out = _greedy(llm, stop=[stop])
    assert (out.text, out.finish_reason, out.stop_reason) == (expect, "stop", stop)
    assert out.token_ids == full.token_ids[: len(out.token_ids)]  # token ids: all generated, up to the stop
    assert len(tok.decode(out.token_ids)) >= full.text.index(stop) + len(stop)
    assert_idle(llm)


def test_stop_string_waits_for_min_tokens(llm: LLM) -> None:
    full = _greedy(llm)
    stop = full.text[:2]  # at the very start: with min_tokens it is skipped
    assert _greedy(llm, stop=[stop]).text == ""
    later = _greedy(llm, stop=[stop], min_tokens=len(full.token_ids) - 1)
    assert later.finish_reason in ("length", "stop") and later.text.startswith(full.text[:2])


def test_stop_strings_need_a_tokenizer(tmp_path: Any) -> None:
    with LLM(str(make_tiny_model(tmp_path)), **ENGINE, kv_cache={"num_blocks": 16, "block_size": 4}) as bare:
        with pytest.raises(RequestError, match="stop strings need a tokenizer"):
            bare.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)


@pytest.mark.parametrize("bad", [[""], [5], 5.0])
def test_bad_stop_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=bad)


# ----------------------------------------------------------------- n > 1
def test_n_samples_are_seed_plus_i_and_share_the_prompt_blocks(llm: LLM) -> None:
    n, seed = 4, 99
    prompt = llm.get_tokenizer().encode(PROMPT)
    assert len(prompt) >= 24
    kv = llm.engine.kv
    hits0 = kv.stats().prefix_hits
    out = llm.generate([prompt], SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=6, ignore_eos=True,
                                                logprobs=1, prompt_logprobs=0), use_tqdm=False)[0]
    hits = kv.stats().prefix_hits - hits0
    full_blocks = (len(prompt) - 1) // 4  # the cache never hands back the block holding the last prompt token
    assert hits >= (n - 1) * full_blocks * 4  # every fork found the prompt computed
    assert [c.index for c in out.outputs] == list(range(n))
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    for i, c in enumerate(out.outputs):
        alone = llm.generate([prompt], SamplingParams(seed=seed + i, temperature=1.0, max_tokens=6, ignore_eos=True,
                                                      logprobs=1), use_tqdm=False)[0].outputs[0]
        assert (c.token_ids, c.text, c.finish_reason) == (alone.token_ids, alone.text, "length")
        assert len(c.logprobs) == 6
    assert len({tuple(c.token_ids) for c in out.outputs}) == n
    assert_idle(llm)


def test_n_streams_and_aborts_as_one_request(llm: LLM) -> None:
    outs = list(llm.stream([PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True)))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert [len(c.token_ids) for c in outs[-1].outputs] == [5, 5, 5]
    assert_idle(llm)
    it = llm.stream([PROMPT], SamplingParams(n=3, temperature=1.0, max_tokens=200, ignore_eos=True))
    first = next(it)
    assert not first.finished
    it.close()  # abort: all three samples end, every block comes back
    assert_idle(llm)


def test_n_with_other_requests_and_stop(llm: LLM) -> None:
    params = [SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=30, ignore_eos=True, stop=["e"])]
    a, b, c = llm.generate([PROMPT, PROMPT, "the dog"], params, use_tqdm=False)
    assert a.outputs[0].token_ids == a.outputs[1].token_ids == b.outputs[0].token_ids  # greedy: all alike
    assert len(c.outputs) == 3
    for s in c.outputs:
        assert "e" not in s.text and (s.finish_reason == "length" or s.stop_reason == "e")
    assert_idle(llm)
