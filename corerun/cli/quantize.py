"""``corerun quantize``: round-to-nearest quantization of a float model into compressed-tensors format."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("model", required=False)
@click.option("--method", type=click.Choice(["int8", "int4"]), required=True,
              help="int8: W8A8 (int8 weights per channel, int8 activations per token); int4: W4A16 (groups of --group-size).")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), required=True, help="The folder to write.")
@click.option("--group-size", type=int, default=128, show_default=True, help="int4: input features per scale.")
@click.option("--asymmetric", is_flag=True, help="int4: a zero point per group besides the scale (min-max range).")
def quantize(model: str | None, method: str, out: Path, group_size: int, asymmetric: bool) -> None:
    """Quantize MODEL (a float safetensors folder or Hub id; the default model when omitted) into OUT,
    in compressed-tensors format (config.json's quantization_config as llm-compressor writes it), which
    corerun and vLLM read."""
    from corerun.errors import CorerunError
    from corerun.quantization.rtn import quantize_folder

    try:
        if model is None:
            from corerun.models.default import default_model_dir

            source = default_model_dir()
        else:
            from corerun.models.hub import resolve_model

            source = Path(resolve_model(model))
        if not (source / "config.json").is_file():
            raise click.UsageError(f"MODEL {model!r}: {source} is not a model folder (no config.json)")
        written = quantize_folder(source, out, method, group_size, asymmetric)
    except (ValueError, CorerunError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {written} ({method}, compressed-tensors); run it with --model {written}")
