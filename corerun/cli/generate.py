"""``corerun generate``: print completions for prompts."""

from __future__ import annotations

import sys

import click

from corerun.cli.options import build_config, engine_options
from corerun.errors import CorerunError


@click.command()
@click.argument("prompts", nargs=-1)
@engine_options
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 means greedy.")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--top-p", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--n", "n", type=int, default=1, show_default=True, help="Completions per prompt.")
@click.option("--stop", "stop", multiple=True, metavar="TEXT", help="End a completion before TEXT (repeatable).")
@click.option("--json-schema", "json_schema", default=None, metavar="SCHEMA|@FILE",
              help="Constrain the output to JSON matching this schema (inline JSON, or @path to a file).")
@click.option("--chat/--no-chat", default=False, help="Wrap each prompt in the model's chat template and print the answer alone.")
@click.option("--stream/--no-stream", default=None, help="Print tokens as they come (default: on for a single prompt and --n 1).")
def generate(
    prompts: tuple[str, ...], config_path, sets, model, attention, sampler, device, dtype,
    temperature, max_tokens, top_p, top_k, seed, n, stop, json_schema, chat, stream,
) -> None:
    """Generate completions for PROMPTs (reads one prompt per line from stdin when none are given).

    Prints each prompt followed by its completion; with --chat, the answer alone."""
    from corerun.llm import LLM
    from corerun.sampling_params import SamplingParams

    if not prompts:
        if sys.stdin is None or sys.stdin.isatty():
            raise click.UsageError("give at least one PROMPT (or pipe prompts, one per line, on stdin)")
        try:
            prompts = tuple(line.rstrip("\n") for line in sys.stdin if line.strip())
        except UnicodeDecodeError as exc:
            raise click.ClickException(f"stdin is not UTF-8 text (byte {exc.start} of a line is 0x{exc.object[exc.start]:02x})") from None
        if not prompts:
            raise click.UsageError("stdin held no prompt (only empty lines); give PROMPTs, or pipe one per line")
    try:
        cfg = build_config(config_path, sets, model=model, attention=attention, sampler=sampler, device=device, dtype=dtype)
        extra = {"structured_outputs": {"json": _schema(json_schema)}} if json_schema is not None else {}
        params = SamplingParams(
            temperature=temperature, max_tokens=max_tokens, seed=seed, n=n, stop=tuple(stop), **extra,
            **({"top_p": top_p} if top_p is not None else {}), **({"top_k": top_k} if top_k is not None else {}),
        )
        llm = LLM(config=cfg)
        texts = list(prompts)
        if chat:
            tok = llm.get_tokenizer()
            if tok is None or not getattr(tok, "chat_template", None):
                raise click.UsageError("--chat: this model has no chat template; leave out --chat to complete the prompt as text")
            texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in texts]
        shown_prompts = [""] * len(prompts) if chat else list(prompts)  # in chat mode the answer stands alone
        if (stream if stream is not None else len(texts) == 1) and n == 1:
            for i, text in enumerate(texts):
                shown = 0
                for j, out in enumerate(llm.stream([text], params)):
                    if j == 0:  # the request was accepted: only now the prompt, so a refusal prints alone
                        click.echo(shown_prompts[i], nl=False)
                    new = out.outputs[0].text
                    click.echo(new[shown:], nl=False)
                    shown = len(new)
                click.echo()
                _raise_if_failed(out)
        else:
            outs = llm.generate(texts, params)
            for p, out in zip(shown_prompts, outs):
                for completion in out.outputs:
                    click.echo(f"{p}{completion.text}")
            for out in outs:
                _raise_if_failed(out)
    except CorerunError as exc:
        raise click.ClickException(str(exc)) from None
    except ValueError as exc:  # pydantic validation of the sampling flags
        raise click.ClickException(str(exc)) from None
    except (click.ClickException, KeyboardInterrupt):
        raise
    except Exception as exc:  # not a corerun error: one line unless -v asks for the traceback
        if _verbose():
            raise
        raise click.ClickException(f"{type(exc).__name__}: {exc} (run with corerun -v generate ... for the traceback)") from None


def _schema(value: str) -> dict:
    """The JSON schema ``--json-schema`` names: inline JSON, or ``@path`` to a file holding it."""
    import json

    where = "--json-schema"
    text = value
    if value.startswith("@"):
        where = f"--json-schema {value}"
        try:
            with open(value[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise click.BadParameter(f"cannot read the schema file {value[1:]!r}: {exc.strerror}", param_hint="--json-schema") from None
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(
            f"{where}: not JSON ({exc}); give a JSON schema such as '{{\"type\": \"object\"}}' or @schema.json",
            param_hint="--json-schema",
        ) from None
    if not isinstance(schema, dict):
        raise click.BadParameter(f"{where}: a JSON schema is an object, got {type(schema).__name__} {text.strip()[:40]!r}",
                                 param_hint="--json-schema")
    return schema


def _verbose() -> bool:
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.find_root().params.get("verbose"))


def _raise_if_failed(out) -> None:
    if out.outputs[0].finish_reason == "error":
        raise click.ClickException(f"request {out.request_id} failed: {out.outputs[0].error}")
