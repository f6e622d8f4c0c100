"""The ``corerun`` command line. Each subcommand lives in its own module of this package."""

from __future__ import annotations

import importlib
import logging

import click

from corerun._version import __version__
from corerun.scaffold import KINDS as SCAFFOLD_KINDS  # plain data: keeps `corerun --help` fast

# subcommand -> "module:attr"; imported only when the subcommand runs (keeps `corerun --help` fast).
SUBCOMMANDS = {
    "generate": "corerun.cli.generate:generate",
    "plugins": "corerun.cli.plugins:plugins",
    "conformance": "corerun.cli.conformance:conformance",
    "bench": "corerun.cli.bench:bench",
    "serve": "corerun.cli.serve:serve",
    "new": "corerun.cli.new:new",
    "quantize": "corerun.cli.quantize:quantize",
}
HELP = {
    "generate": "Generate completions for PROMPTs (the built-in default model unless --model/--config name one).",
    "plugins": "List installed plugins: distribution, version, what each provides, available or why not.",
    "conformance": "Run the conformance suite against an installed implementation (KIND:NAME).",
    "bench": "Offline throughput / latency benchmark on a standard workload.",
    "serve": "Serve the model over HTTP with OpenAI's API (completions, chat, models, health, metrics).",
    "new": f"Write a ready pip distribution for a new plugin: corerun new {'|'.join(SCAFFOLD_KINDS)} NAME.",
    "quantize": "Quantize a float model (int8 W8A8 or int4 W4A16, round to nearest) into compressed-tensors format.",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        ref = SUBCOMMANDS.get(name)
        if ref is None:
            return None
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(n, HELP[n]) for n in self.list_commands(ctx)])


@click.group(cls=LazyGroup)
@click.version_option(__version__, prog_name="corerun")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
def cli(verbose: int) -> None:
    """corerun: the model-runner core of an LLM inference engine, made pluggable."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def main() -> None:
    cli()
