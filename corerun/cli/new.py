"""``corerun new KIND NAME``: write a ready pip distribution for a new plugin (see corerun.scaffold)."""

from __future__ import annotations

from pathlib import Path

import click

from corerun.scaffold import KINDS


@click.command("new")
@click.argument("kind", type=click.Choice(list(KINDS)))
@click.argument("name")
@click.option("--dir", "parent", type=click.Path(file_okay=False, path_type=Path), default=Path("."), show_default=True,
              help="Folder to write the distribution's folder into.")
def new(kind: str, name: str, parent: Path) -> None:
    """Write a plugin distribution for KIND (one of the kinds listed above) named NAME: entry point,
    hook, capabilities, a working implementation that delegates to corerun's reference code, a tests/
    folder running the conformance suite, and a README.  Replace the part marked "the kernel"."""
    from corerun.scaffold import placeholders, scaffold

    try:
        root = scaffold(kind, name, parent)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    values = placeholders(kind, name)
    click.echo(f"wrote {root}/ ({values['distribution']}, plugin id {values['plugin_id']})")
    click.echo(f"next: pip install -e {root} && corerun conformance {kind}:{values['registered']}")
