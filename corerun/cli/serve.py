"""``corerun serve``: the OpenAI-compatible HTTP server (corerun.server)."""

from __future__ import annotations

import click

from corerun.cli.options import build_config, engine_options
from corerun.errors import CorerunError


@click.command()
@engine_options
@click.option("--host", default=None, help="Address to listen on (server.host; default 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Port (server.port; default 8000).")
@click.option("--served-model-name", default=None, help="The model name clients ask for (server.served_model_name).")
@click.option("--api-key", envvar="CORERUN_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every /v1 route (server.api_key; env CORERUN_API_KEY).")
@click.option("--allowed-origins", multiple=True,
              help="A browser origin allowed to call the server, e.g. http://localhost:3000 (repeatable; '*': any; "
                   "server.allowed_origins). Other cross-origin requests get 403.")
@click.option("--allowed-hosts", multiple=True,
              help="A Host name served besides the listening address (repeatable; '*': any; server.allowed_hosts).")
@click.option("--tool-call-parser", default=None,
              help="Reads the model's tool calls: hermes, llama3_json, mistral, ... (server.tool_call_parser; default "
                   "auto: from the chat template; none: off).")
@click.option("--reasoning-parser", default=None,
              help="Splits the model's thinking into reasoning_content: deepseek_r1, qwen3, ... (server.reasoning_parser).")
@click.option("--data-parallel-size", type=click.IntRange(min=1), default=None,
              help="Engine replicas, each in its own process with its own KV cache, behind this one server; requests "
                   "go to the least busy (server.data_parallel_size; default 1).")
@click.option("--lora-modules", multiple=True, metavar="NAME=PATH",
              help="A PEFT adapter folder served as model NAME, with the base as its parent (repeatable; "
                   "server.lora_modules; turns lora.enabled on).")
@click.option("--enable-lora-runtime-updating", is_flag=True, default=False,
              help="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (server.enable_lora_runtime_updating; "
                   "turns lora.enabled on).")
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]), default="info",
              show_default=True, help="uvicorn's log level (info logs each request).")
def serve(config_path, sets, model, attention, sampler, device, dtype, host, port, served_model_name, api_key,
          allowed_origins, allowed_hosts, tool_call_parser, reasoning_parser, data_parallel_size, lora_modules,
          enable_lora_runtime_updating, log_level) -> None:
    """Serve the model over HTTP with OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics. SIGTERM or Ctrl-C stops it gracefully."""
    from corerun.server.run import check_installed

    try:
        check_installed()
    except ImportError as exc:
        raise click.ClickException(str(exc)) from None
    given = (("host", host), ("port", port), ("served_model_name", served_model_name), ("api_key", api_key),
             ("allowed_origins", list(allowed_origins) or None), ("allowed_hosts", list(allowed_hosts) or None),
             ("tool_call_parser", tool_call_parser), ("reasoning_parser", reasoning_parser),
             ("data_parallel_size", data_parallel_size))
    server = {k: v for k, v in given if v is not None}
    lora = lora_options(lora_modules, enable_lora_runtime_updating, server)
    try:
        cfg = build_config(config_path, sets, model=model, attention=attention, sampler=sampler, device=device,
                           dtype=dtype, server=server or None, lora=lora)
        from corerun.llm import LLM
        from corerun.server.serving import model_name
        from corerun.server.run import serve as run

        if cfg.server.data_parallel_size > 1:
            from corerun.server.data_parallel.front import DataParallelEngine

            llm = DataParallelEngine(cfg)
        else:
            llm = LLM(config=cfg)
        click.echo(f"corerun: serving {model_name(llm)} on http://{cfg.server.host}:{cfg.server.port}/v1", err=True)
        run(llm, log_level=log_level)
    except CorerunError as exc:
        raise click.ClickException(str(exc)) from None


def lora_options(modules: tuple[str, ...], runtime_updating: bool, server: dict) -> dict | None:
    """``--lora-modules NAME=PATH`` and ``--enable-lora-runtime-updating`` into ``server`` (both turn LoRA on)."""
    if not modules and not runtime_updating:
        return None
    parsed: dict[str, str] = {}
    for item in modules:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise click.BadParameter(f"{item!r}: expected NAME=PATH (an adapter name, then its PEFT folder)",
                                     param_hint="--lora-modules")
        if name in parsed:
            raise click.BadParameter(f"adapter name {name!r} is given twice", param_hint="--lora-modules")
        parsed[name.strip()] = path.strip()
    if parsed:
        server["lora_modules"] = parsed
    if runtime_updating:
        server["enable_lora_runtime_updating"] = True
    return {"enabled": True}
