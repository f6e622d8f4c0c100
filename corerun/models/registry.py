"""Model families by the ``architectures`` name in ``config.json``, as the installed ``model`` plugins register them.

corerun's own families (Llama, Mistral, Qwen2, Qwen3, ...) register through the same hook,
``corerun_models``, in :mod:`corerun.plugin.builtin`; a distribution adds architectures with::

    @corerun.hookimpl
    def corerun_models(register):
        register("MyForCausalLM", "my_family.model:MyForCausalLM",
                 capabilities=ModelCapabilities(tensor_parallel=False, attention=frozenset({"full"})))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from corerun.models.config import ModelConfig
from corerun.models.errors import ModelLoadError, UnsupportedModelError

if TYPE_CHECKING:
    from corerun.plugin.registry import Registration, Registry


@dataclass(frozen=True)
class ModelFamily:
    """The family serving one architecture: its class, its declared capabilities and who registered it."""

    architecture: str
    cls: type[nn.Module]
    capabilities: Any  # corerun.plugin.capabilities.ModelCapabilities
    registration: "Registration"


def _registry(registry: "Registry | None") -> "Registry":
    from corerun.plugin.registry import get_registry

    return registry if registry is not None else get_registry()


def supported_architectures(registry: "Registry | None" = None) -> list[str]:
    """Every architecture an installed ``model`` plugin registers, sorted."""
    return _registry(registry).names("model")


def model_family(config: ModelConfig, registry: "Registry | None" = None) -> ModelFamily:
    """The family of the first of ``config.architectures`` that an installed plugin registers.

    Raises :class:`UnsupportedModelError` listing every installed architecture (with its distribution)
    and the model plugins that failed to load, or :class:`ModelLoadError` when the family's module
    does not import.
    """
    from corerun.plugin.capabilities import ModelCapabilities
    from corerun.plugin.registry import resolve

    reg = _registry(registry)
    table = reg.registrations["model"]
    for arch in config.architectures:
        if arch not in table:
            continue
        registration = table[arch]
        try:
            cls = resolve(registration.factory)
        except Exception as exc:
            raise ModelLoadError(
                f"model family {arch!r} from {registration.distribution} {registration.version} cannot be imported "
                f"({registration.factory}): {type(exc).__name__}: {exc}"
            ) from exc
        return ModelFamily(arch, cls, registration.capabilities or ModelCapabilities(), registration)
    got = ", ".join(config.architectures) if config.architectures else "none listed"
    installed = ", ".join(f"{n} ({r.distribution})" for n, r in sorted(table.items())) or "none"
    msg = (f"config.json architectures [{got}] (model_type {config.model_type!r}) not supported; "
           f"installed model families: {installed}")
    if reg.load_errors:
        msg += ". Plugins that failed to load: " + "; ".join(f"'{e.plugin}' ({e.distribution}): {e.error}" for e in reg.load_errors)
    raise UnsupportedModelError(msg + "; a model plugin adds an architecture (docs/models.md)")


def get_model_class(config: ModelConfig, registry: "Registry | None" = None) -> type[nn.Module]:
    """The class for the first of ``config.architectures`` that an installed plugin registers."""
    return model_family(config, registry).cls
