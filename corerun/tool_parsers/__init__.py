"""Tool-call and reasoning parsers: the model's text in its own syntax -> OpenAI's ``content``,
``tool_calls`` and ``reasoning_content``, whole or streamed (protocols in
:mod:`corerun.tool_parsers.protocol`).  Two plugin kinds, ``tool_parser`` and ``reasoning_parser``;
corerun's own are registered in :mod:`corerun.plugin.builtin`.  Nothing here imports torch."""

from corerun.tool_parsers.calls import StreamingToolParser
from corerun.tool_parsers.protocol import (
    ParsedTools,
    ReasoningDelta,
    ReasoningParser,
    ReasoningParserCapabilities,
    ReasoningStream,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolDelta,
    ToolParser,
    ToolParserCapabilities,
    assemble,
)

__all__ = [
    "ParsedTools",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningParserCapabilities",
    "ReasoningStream",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolDelta",
    "ToolParser",
    "ToolParserCapabilities",
    "assemble",
]
