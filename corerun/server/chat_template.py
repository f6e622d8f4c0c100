"""Chat templates rendered in jinja2's sandbox, with limits.

A client chooses none of the template: ``chat_template`` in ``chat_template_kwargs`` is refused and the
other keys are an allow-list of plain values.  The model's own template runs in jinja2's immutable
sandbox with the globals and filters transformers gives it, and may neither write more than
``server.chat_template_max_chars`` characters, nor build a string or list that long (``*``, ``+``,
``%``, ``~`` and the padding filters are checked before they allocate), nor run longer than
``server.chat_template_timeout_s`` (checked on every line the template executes, so nested loops that
write nothing stop too).
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from corerun.server import protocol as P

# Keys of chat_template_kwargs that templates in the wild read, each a plain value.
ALLOWED_KWARGS: dict[str, tuple[type, ...]] = {
    "enable_thinking": (bool,),
    "thinking": (bool,),
    "reasoning_effort": (str,),
    "date_string": (str,),
    "custom_instructions": (str,),
}
MAX_KWARG_CHARS = 4096


class TemplateLimit(Exception):
    """A chat template went past one of the server's limits (its message says which)."""


def check_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` after the allow-list; ``APIError(400)`` naming the key otherwise."""
    if not kwargs:
        return {}
    for key, value in kwargs.items():
        field = f"chat_template_kwargs.{key}"
        if key == "chat_template":
            raise P.APIError(400, f"{field}: a request may not replace the model's chat template; leave it out",
                             param="chat_template_kwargs")
        if key not in ALLOWED_KWARGS:
            raise P.APIError(400, f"{field}: unknown key; allowed keys are {', '.join(sorted(ALLOWED_KWARGS))}",
                             param="chat_template_kwargs")
        kinds = ALLOWED_KWARGS[key]
        if value is not None and not isinstance(value, kinds):
            raise P.APIError(400, f"{field}: must be {' or '.join(k.__name__ for k in kinds)} or null, got "
                             f"{type(value).__name__}", param="chat_template_kwargs")
        if isinstance(value, str) and len(value) > MAX_KWARG_CHARS:
            raise P.APIError(400, f"{field}: {len(value)} characters, at most {MAX_KWARG_CHARS}",
                             param="chat_template_kwargs")
    return dict(kwargs)


class _Generation(Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` marks the assistant's text; rendering keeps it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _CheckedConcat(CodeGenerator):
    """``a ~ b`` goes through ``environment.checked_concat``, so a doubling loop meets the size limit."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


_PRINTF_WIDTH = re.compile(r"%[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox where no operator or filter builds a value above ``max_chars``."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CheckedConcat

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
        self.max_chars = max_chars
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        self.filters["tojson"] = _tojson
        for name in ("center", "indent", "format"):  # the filters that pad: a width is an allocation
            self.filters[name] = self._bounded_filter(name, self.filters[name])

    def _too_big(self, what: str, size: int) -> TemplateLimit:
        return TemplateLimit(f"the chat template built {what} of {size} characters, above "
                             f"server.chat_template_max_chars={self.max_chars}")

    def _check(self, what: str, size: int) -> None:
        if size > self.max_chars:
            raise self._too_big(what, size)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    self._check("a repetition", len(seq) * times)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right * abs(left).bit_length() > 4 * self.max_chars:
                raise TemplateLimit(f"the chat template raised {left} to the power {right}, a number too large "
                                    f"for server.chat_template_max_chars={self.max_chars}")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            self._check("a concatenation", len(left) + len(right))
        elif operator == "%" and isinstance(left, str):
            self._check_printf(left, right)
        return super().call_binop(context, operator, left, right)

    def _check_printf(self, fmt: str, args: Any) -> None:
        for width, precision in _PRINTF_WIDTH.findall(fmt):
            for n in (width, precision):
                if n == "*":
                    raise TemplateLimit("the chat template used a '*' width in a % format; write the width out")
                if n:
                    self._check("a formatted field", int(n))

    def checked_concat(self, parts: tuple[Any, ...]) -> str:
        text = "".join(map(str, parts))
        self._check("a string", len(text))
        return text

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        fmt = super().wrap_str_format(value)
        if fmt is None:
            return None

        def checked(*args: Any, **kwargs: Any) -> str:
            for n in re.findall(r"\d+", value.__self__):  # widths and precisions in "{:>N.M}"
                self._check("a formatted field", int(n))
            text = fmt(*args, **kwargs)
            self._check("a string", len(text))
            return text

        return checked

    def _bounded_filter(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def bounded(*args: Any, **kwargs: Any) -> Any:
            values = [a for a in args[1:] if isinstance(a, int)] + [v for v in kwargs.values() if isinstance(v, int)]
            if isinstance(args[0], str) and name == "format":
                self._check_printf(args[0], None)
            for v in values:
                self._check(f"a '{name}' width", v)
            out = fn(*args, **kwargs)
            if isinstance(out, str):
                self._check(f"the result of '{name}'", len(out))
            return out

        for attr in ("jinja_pass_arg",):  # keep how jinja2 calls it (context / environment first)
            if hasattr(fn, attr):
                setattr(bounded, attr, getattr(fn, attr))
        return bounded


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str, max_chars: int) -> jinja2.Template:
    return LimitedEnvironment(max_chars).from_string(source)


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    tokens = getattr(tokenizer, "special_tokens_map", None) or {}
    return {k: v for k, v in tokens.items() if isinstance(k, str)}


def render(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool, kwargs: dict[str, Any],
           max_chars: int, timeout_s: float) -> str:
    """The tokenizer's chat template over ``messages`` as text, within the limits (``TemplateLimit`` past them;
    ``jinja2.TemplateError`` when the template refuses the messages)."""
    template = compile_template(tokenizer.chat_template, max_chars)
    context = {**_special_tokens(tokenizer), "messages": messages, "tools": None, "documents": None,
               "add_generation_prompt": add_generation_prompt, **kwargs}
    out: list[str] = []
    size = 0
    with _deadline(timeout_s):
        for piece in template.generate(**context):
            size += len(piece)
            if size > max_chars:
                raise TemplateLimit(f"the chat template wrote more than server.chat_template_max_chars={max_chars} "
                                    "characters")
            out.append(piece)
    return "".join(out)


class _deadline:
    """Trace the template's own frames on this thread: past ``seconds`` the next line it runs raises."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        end = time.monotonic() + self.seconds
        seconds = self.seconds

        def line(frame: Any, event: str, arg: Any) -> Any:
            if time.monotonic() > end:
                raise TemplateLimit(f"the chat template ran longer than server.chat_template_timeout_s={seconds}")
            return line

        def call(frame: Any, event: str, arg: Any) -> Any:
            return line if frame.f_code.co_filename == "<template>" else None

        self.before = sys.gettrace()
        sys.settrace(call)

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(self.before)
