"""Output processing through the engine: stop strings found by each request's ``StopMatcher`` (only the
held tail rescanned each step) and ``skip_special_tokens``; the chat route keeping special tokens for a
tool parser whose markers are special tokens.

References: the text of the same greedy request without stop strings, cut by a brute-force search;
the tokenizer's own EOS string.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Iterator

import pytest

from corerun import LLM, SamplingParams
from corerun.engine.output_processor import OutputProcessor
from tests.helpers.serving import ENGINE, tiny_chat_model

PROMPT = "the cat sat on the mat and the dog sat on the log"
GREEDY = dict(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    llm = LLM(str(tiny_chat_model(tmp_path_factory.mktemp("outproc"))), **ENGINE,
              kv_cache={"num_blocks": 64, "block_size": 4})
    yield llm
    llm.shutdown()


def _brute_cut(text: str, stops: list[str]) -> tuple[str, str] | None:
    """The text before the earliest stop string (the longer of two at one place), and that string."""
    hits = [(i, -len(s), s) for s in stops for i in range(len(text)) if text.startswith(s, i)]
    if not hits:
        return None
    i, _, s = min(hits)
    return text[:i], s


@pytest.mark.timeout(120)
def test_stop_strings_cut_where_a_brute_force_search_cuts(llm: LLM) -> None:
    full = llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    # (a stop string the last token completes loses to the length limit: cases end before it)
    text = llm.get_tokenizer().decode(full.token_ids[:-1])
    assert full.text.startswith(text) and len(text) > 12
    cases = [
        [text[5:7]],  # short, early
        [text[-4:-1], "\x00never"],  # late, with one that never occurs
        [text[3:9], text[8:10], "zz" * 40],  # overlapping, and one longer than the whole text
        [text[10:11], text[10:13]],  # two at one place: the longer wins
    ]
    for stops in cases:
        want = _brute_cut(full.text, stops)
        assert want is not None
        streamed = [o.outputs[0].text for o in llm.stream([PROMPT], SamplingParams(**GREEDY, stop=stops))]
        out = llm.generate([PROMPT], SamplingParams(**GREEDY, stop=stops), use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason, out.stop_reason) == (want[0], "stop", want[1]), stops
        assert streamed[-1] == want[0]
        assert all(want[0].startswith(t) for t in streamed), stops  # never a character the stop removed
        kept = llm.generate([PROMPT], SamplingParams(**GREEDY, stop=stops, include_stop_str_in_output=True),
                            use_tqdm=False)[0].outputs[0]
        assert kept.text == want[0] + want[1]
    assert not llm.engine.requests


@pytest.mark.timeout(120)
def test_skip_special_tokens(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    forced = dict(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})  # three EOS tokens
    skipped = llm.generate([PROMPT], SamplingParams(**forced), use_tqdm=False)[0].outputs[0]
    kept = llm.generate([PROMPT], SamplingParams(**forced, skip_special_tokens=False), use_tqdm=False)[0].outputs[0]
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert skipped.text == ""
    assert kept.text == tok.eos_token * 3
    streamed = [o.outputs[0].text for o in llm.stream([PROMPT], SamplingParams(**forced, skip_special_tokens=False))]
    assert streamed[-1] == tok.eos_token * 3


def test_skip_special_tokens_defaults_true() -> None:
    assert SamplingParams().skip_special_tokens is True
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="sometimes")


@pytest.mark.parametrize(("parser", "specials", "keep"), [
    ("mistral", ["[TOOL_CALLS]", "</s>"], True),  # its marker is a control token: the text must keep it
    ("mistral", ["</s>"], False),  # a tokenizer where it is plain text
    ("hermes", ["[TOOL_CALLS]", "</s>"], False),
])
def test_chat_keeps_special_tokens_for_a_parser_whose_markers_are_special(parser: str, specials: list[str],
                                                                           keep: bool) -> None:
    from corerun.server import protocol as P
    from corerun.server.tool_calls import choose_parsers, plan, with_special_tokens

    tokenizer = SimpleNamespace(chat_template="", all_special_tokens=specials)
    parsers = choose_parsers(SimpleNamespace(tool_call_parser=parser, reasoning_parser=None), tokenizer)
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    req = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools)
    params = with_special_tokens(SamplingParams(), plan(req, parsers))
    assert params.skip_special_tokens is (not keep)
    no_tools = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=tools,
                                       tool_choice="none")
    assert with_special_tokens(SamplingParams(), plan(no_tools, parsers)).skip_special_tokens is True


def test_output_processor_reads_skip_special_tokens_per_request() -> None:
    class Tok:  # decodes id i as "<i>" when special (i < 3) and kept, else as "w"
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join("" if i < 3 and skip_special_tokens else f"<{i}>" if i < 3 else "w" for i in ids)

    from corerun.core.sequence import Sequence

    out = OutputProcessor(Tok())
    texts = []
    for sid, skip in enumerate((True, False)):
        seq = Sequence(sid, str(sid), [7, 8], SamplingParams(skip_special_tokens=skip))
        seq.token_ids += [1, 9, 2]
        texts.append(out.output(seq).outputs[0].text)
    assert texts == ["w", "<1>w<2>"]
