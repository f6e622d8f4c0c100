"""Tool calling and reasoning output in chat completions (docs/tool-calling.md).

At startup :func:`choose_parsers` picks the tool-call parser (``server.tool_call_parser``; ``auto``:
the one whose markers the chat template holds) and the reasoning parser (``server.reasoning_parser``).
Per request, :func:`plan` checks ``tools``, ``tool_choice`` and ``parallel_tool_calls`` and returns a
:class:`ToolPlan`: the tools for the chat template, and for ``required`` or a named function the JSON
schema that the structured-output processor enforces, so the arguments always parse.  Per choice,
:class:`ChoiceOutput` turns the model's text into OpenAI's message fields (``content``,
``reasoning_content``, ``tool_calls``), whole or as stream deltas.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from corerun.server import protocol as P
from corerun.tool_parsers.calls import CallBuilder, CallObjects, openai_call_id
from corerun.tool_parsers.json_scan import skip
from corerun.tool_parsers.protocol import ReasoningDelta, ToolCall, ToolDelta, assemble

logger = logging.getLogger("corerun.server")


@dataclass
class ChatParsers:
    """The parsers a server uses for every chat request (``None``: none chosen)."""

    tool: Any = None
    tool_name: str | None = None
    reasoning: Any = None
    reasoning_name: str | None = None
    keep_special: bool = False  # the tool parser's markers are special tokens: the text must keep them
    template_tools: bool = True  # the chat template renders ``tools``; False: corerun writes them in a system message


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(template, dict):  # named templates ("default", "tool_use")
        return "\n".join(str(t) for t in template.values())
    return template or ""


def auto_tool_parser(registry: Any, template: str) -> tuple[str | None, str]:
    """The one tool parser whose ``template_markers`` the chat template holds, and why (or None, and why not)."""
    hits = [name for name in registry.names("tool_parser")
            if any(m in template for m in getattr(registry.get("tool_parser", name).capabilities, "template_markers", ()))]
    if len(hits) == 1:
        return hits[0], f"the chat template writes its markers"
    if not hits:
        return None, "no tool parser's markers are in the chat template"
    return None, f"the chat template holds the markers of several tool parsers ({', '.join(hits)})"


def choose_parsers(cfg: Any, tokenizer: Any, registry: Any = None) -> ChatParsers:
    """The parsers ``server.tool_call_parser`` and ``server.reasoning_parser`` name (``auto``, ``none``, a name)."""
    from corerun.plugin.registry import announce, get_registry

    registry = registry or get_registry()
    template = _template_text(tokenizer)
    out = ChatParsers(template_tools=re.search(r"\btools\b", template) is not None)
    if not out.template_tools and template:
        announce("chat template: it does not render tools; requests with tools get them in a system message")
    name = getattr(cfg, "tool_call_parser", "auto") or "none"
    if name == "auto":
        name, why = auto_tool_parser(registry, template)
        announce("tool-call parser: %s (%s)", f"auto chose '{name}'" if name else "none", why)
    if name and name != "none":
        out.tool, out.tool_name = registry.create("tool_parser", name), name
        markers = getattr(registry.get("tool_parser", name).capabilities, "template_markers", ())
        out.keep_special = bool(set(markers) & set(getattr(tokenizer, "all_special_tokens", None) or ()))
    reasoning = getattr(cfg, "reasoning_parser", None)
    if reasoning and reasoning != "none":
        out.reasoning, out.reasoning_name = registry.create("reasoning_parser", reasoning), reasoning
    return out


# ------------------------------------------------------------------ requests
@dataclass
class ToolPlan:
    """What one chat request asks of tools: ``mode`` none | auto | required | named."""

    mode: str
    tools: list[dict[str, Any]] | None = None  # for the chat template
    function: str | None = None  # the named function
    schema: dict[str, Any] | None = None  # enforced on the output (required, named)
    parallel: bool = True
    parsers: ChatParsers = field(default_factory=ChatParsers)

    def output(self) -> "ChoiceOutput":
        return ChoiceOutput(self)


def _check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise P.APIError(400, f"{where}: must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                             f"{json.dumps(tool)[:80]}", param="tools")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise P.APIError(400, f"{where}.function.name: must be a non-empty string, got {name!r}", param="tools")
        if name in names:
            raise P.APIError(400, f"{where}.function.name: {name!r} is defined twice; names must be distinct", param="tools")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise P.APIError(400, f"{where}.function.parameters: must be a JSON schema (an object), got "
                             f"{type(params).__name__}", param="tools")
    return tools


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def plan(req: P.ChatCompletionRequest, parsers: ChatParsers) -> ToolPlan | None:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked; ``None`` when the
    answer needs no parsing at all (no tools, no reasoning parser).  For ``required`` and named functions
    ``req.structured_outputs`` is set to the JSON schema built from the tools."""
    tools = _check_tools(req.tools) if req.tools else None
    choice = req.tool_choice
    parallel = True if req.parallel_tool_calls is None else req.parallel_tool_calls
    if choice is None:
        mode = "auto" if tools else "none"
    elif choice in ("none", "auto", "required"):
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        mode = "named"
    else:
        raise P.APIError(400, f"tool_choice: must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {json.dumps(choice)[:80]}", param="tool_choice")
    if mode in ("auto", "required", "named") and not tools:
        raise P.APIError(400, f"tool_choice: {json.dumps(choice)} needs tools; the request has none", param="tool_choice")
    if mode == "none" and not tools and parsers.reasoning is None:
        return None
    out = ToolPlan(mode, tools=tools if mode != "none" else None, parallel=parallel, parsers=parsers)
    if mode == "auto" and parsers.tool is None:
        why = "" if parsers.template_tools else " (this model's chat template renders no tools, so none was chosen from it)"
        raise P.APIError(400, f"tool_choice: 'auto' needs a tool-call parser, and this server has none{why}: start it "
                         "with --tool-call-parser NAME (corerun plugins lists them), or send tool_choice 'required' or "
                         "a named function", param="tool_choice")
    if mode == "named":
        wanted = choice["function"].get("name")
        found = [t for t in tools or () if t["function"]["name"] == wanted]
        if not found:
            raise P.APIError(400, f"tool_choice.function.name: {wanted!r} is not among the tools "
                             f"({', '.join(t['function']['name'] for t in tools or ())})", param="tool_choice")
        out.function, out.schema = wanted, _parameters(found[0])
    elif mode == "required":
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools or ()]
        out.schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            out.schema["maxItems"] = 1
    if out.schema is not None:
        given = P.structured_field(req)
        if given is not None:
            raise P.APIError(400, f"tool_choice: {mode} constrains the output to the tool's arguments, so it cannot "
                             f"be combined with {given}", param="tool_choice")
        req.structured_outputs = {"json": out.schema}
    return out


def with_special_tokens(params: Any, tools: ToolPlan | None) -> Any:
    """``params`` keeping special tokens in the text (``skip_special_tokens`` false) when the request may
    call tools and the tool parser's markers are special tokens (Mistral's ``[TOOL_CALLS]``): a text
    without them has no calls to find."""
    if tools is None or tools.mode == "none" or not tools.parsers.keep_special:
        return params
    return params.model_copy(update={"skip_special_tokens": False})


def for_template(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 parsers: ChatParsers) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument for the chat template.  A template that never reads
    ``tools`` (the default model's) gets the tool definitions in a system message instead, and the
    calls in the history as the text ``tool_choice: "required"`` makes a model write."""
    messages = template_messages(messages)
    if parsers.template_tools:
        return messages, tools
    messages = [_calls_as_text(m) for m in messages]
    if tools:
        text = TOOLS_SYSTEM + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        if messages and messages[0].get("role") == "system":
            first = messages[0]
            messages[0] = {**first, "content": f"{first.get('content') or ''}\n\n{text}"}
        else:
            messages.insert(0, {"role": "system", "content": text})
    return messages, None


TOOLS_SYSTEM = "You can call these tools; each line is one tool's definition in JSON:\n"


def _calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's ``tool_calls`` appended to its content as ``[{"name": ..., "parameters": ...}]``."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = json.dumps([{"name": c["function"]["name"], "parameters": c["function"]["arguments"]} for c in calls],
                         ensure_ascii=False)
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": (message.get("content") or "") + written}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a chat template: an assistant's ``tool_calls`` with their JSON ``arguments`` as objects
    (what Hugging Face templates render with ``tojson``); ``APIError`` naming one that is not JSON."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise P.APIError(400, f"messages.{i}.tool_calls.{j}: must be {{\"id\", \"type\": \"function\", "
                                     "\"function\": {\"name\", \"arguments\"}}", param="messages")
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise P.APIError(400, f"messages.{i}.tool_calls.{j}.function.arguments: not JSON: "
                                         f"{args[:60]!r}", param="messages") from None
                fixed.append({**call, "function": {**fn, "arguments": args}})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


# ------------------------------------------------------------------ answers
class _NamedStream:
    """``tool_choice`` naming a function: the whole answer is that call's arguments, sent as they come."""

    def __init__(self, name: str) -> None:
        self.call = CallBuilder(0, openai_call_id())
        self.name = name

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        if not self.call.named and text:
            out.tool_calls.append(self.call.name(self.name))
        piece = self.call.arguments(text, False)
        if piece is not None:
            out.tool_calls.append(piece)
        return out

    def finish(self) -> ToolDelta:
        out = ToolDelta()
        if not self.call.named:  # an empty answer: the call still comes, with no arguments
            out.tool_calls += [self.call.name(self.name), self.call.arguments("{}", True)]
        return out


class _RequiredStream:
    """``tool_choice: required``: the answer is the JSON list ``[{"name": ..., "parameters": {...}}, ...]``."""

    def __init__(self) -> None:
        self.calls: CallObjects | None = None
        self.done = False

    def feed(self, text: str, final: bool = False) -> ToolDelta:
        out = ToolDelta()
        if self.calls is None:
            i = skip(text, 0)
            if i >= len(text):
                return out
            self.calls, text = CallObjects(",", "]", openai_call_id), text[i + 1:]  # (the grammar opens with "[")
        if not self.done:
            deltas, rest = self.calls.feed(text, final)
            out.tool_calls += deltas
            self.done = rest is not None
        return out

    def finish(self) -> ToolDelta:
        return self.feed("", True)


class ChoiceOutput:
    """One choice's text as OpenAI's message fields: the thinking (reasoning parser) first, then the calls
    in the answer (the tool parser, or the enforced JSON of ``required`` / a named function)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        structured = plan.mode in ("required", "named")
        # the grammar holds from the first token: no thinking is read before the JSON
        self.reasoning = None if structured or plan.parsers.reasoning is None else plan.parsers.reasoning.stream()
        if plan.mode == "named":
            self.tools: Any = _NamedStream(plan.function or "")
        elif plan.mode == "required":
            self.tools = _RequiredStream()
        elif plan.mode == "auto":
            self.tools = plan.parsers.tool.stream(plan.tools)
        else:
            self.tools = None
        self.calls = 0  # calls begun so far
        self.limit = None if plan.parallel else 1

    def _split(self, text: str, final: bool) -> ReasoningDelta:
        if self.reasoning is None:
            return ReasoningDelta("", text)
        first = self.reasoning.feed(text)
        if not final:
            return first
        last = self.reasoning.finish()
        return ReasoningDelta(first.reasoning + last.reasoning, first.content + last.content)

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """OpenAI's delta fields for the next ``text`` of the answer (``final``: it is the last)."""
        split = self._split(text, final)
        out: dict[str, Any] = {}
        if split.reasoning:
            out["reasoning_content"] = split.reasoning
        if self.tools is None:
            if split.content:
                out["content"] = split.content
            return out
        pieces = [self.tools.feed(split.content)] + ([self.tools.finish()] if final else [])
        content = "".join(p.content for p in pieces)
        calls = [c for p in pieces for c in p.tool_calls if self.limit is None or c.index < self.limit]
        if content:
            out["content"] = content
        if calls:
            self.calls = max(self.calls, max(c.index for c in calls) + 1)
            out["tool_calls"] = [c.to_openai() for c in calls]
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as OpenAI's assistant message."""
        split = self._split(text, True)
        msg: dict[str, Any] = {"role": "assistant", "content": split.content}
        if self.plan.parsers.reasoning is not None and self.reasoning is not None:
            msg["reasoning_content"] = split.reasoning or None
        if self.tools is None:
            return msg
        got = assemble([self.tools.feed(split.content), self.tools.finish()])
        calls: tuple[ToolCall, ...] = got.tool_calls[:self.limit] if self.limit else got.tool_calls
        self.calls = len(calls)
        msg["content"] = (got.content if got.content.strip() else None) if calls else got.content
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        """``tool_calls`` for an answer that made calls and ended by itself."""
        return "tool_calls" if reason == "stop" and self.calls else reason
