"""Reasoning parsers: the thinking between ``<think>`` and ``</think>`` becomes ``reasoning_content``.

- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the answer starts inside the
  thinking (a ``<think>`` the model writes again is dropped); without ``</think>`` it is all thinking.
- ``qwen3``: thinking only when the answer opens with ``<think>`` (Qwen3 with ``enable_thinking``;
  with ``chat_template_kwargs: {"enable_thinking": false}`` it writes none and all is content).
"""

from __future__ import annotations

from typing import Any, ClassVar

from corerun.tool_parsers.calls import BufferedStream
from corerun.tool_parsers.protocol import ReasoningDelta, ReasoningParserCapabilities


class ThinkStream(BufferedStream):
    def __init__(self, caps: ReasoningParserCapabilities) -> None:
        super().__init__()
        self.start, self.end = caps.start, caps.end
        self.opens_inside = caps.starts_in_reasoning
        self.state = "start"  # start -> reasoning -> content, or start -> content

    def _run(self, final: bool) -> ReasoningDelta:
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if not final and (not head or (self.start.startswith(head) and head != self.start)):
                return ReasoningDelta()  # the opening tag may still be coming
            if head.startswith(self.start):
                self.buf, self.state = head[len(self.start):], "reasoning"
            else:
                self.state = "reasoning" if self.opens_inside else "content"
        if self.state == "reasoning":
            reasoning, ended = self.text_before(self.end, final)
            if not ended:
                return ReasoningDelta(reasoning, "")
            self.state = "content"
        content, self.buf = self.buf, ""
        return ReasoningDelta(reasoning, content)


class ThinkReasoningParser:
    name: ClassVar[str] = "think"
    capabilities: ClassVar[ReasoningParserCapabilities] = ReasoningParserCapabilities()

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"reasoning parser '{self.name}' takes no options, got {sorted(options)}")

    def stream(self) -> ThinkStream:
        return ThinkStream(self.capabilities)

    def parse(self, text: str) -> ReasoningDelta:
        s = self.stream()
        a, b = s.feed(text), s.finish()
        return ReasoningDelta(a.reasoning + b.reasoning, a.content + b.content)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    capabilities = ReasoningParserCapabilities(starts_in_reasoning=True)


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    capabilities = ReasoningParserCapabilities(starts_in_reasoning=False)
