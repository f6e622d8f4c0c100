"""Graph runners: run the composed model for one step, eagerly (``eager``) or by CUDA-graph replay (``cuda``).

Importing this package imports no torch; the runners live in ``corerun.graph.eager`` and
``corerun.graph.cuda`` and are registered in ``corerun.builtin_plugins`` like any plugin's.
:func:`choose_graph_runner` is the rule behind ``graph: {runner: auto}``.
"""

from __future__ import annotations

from typing import Any


def _device_type(device: Any) -> str:
    return getattr(device, "type", None) or str(device).split(":")[0]


def choose_graph_runner(device: Any, attention_capabilities: Any, attention_name: str | None = None) -> tuple[str, str]:
    """The runner ``graph: {runner: auto}`` resolves to, and why: ``(name, reason)``.

    ``cuda`` on a CUDA device when the attention backend declares ``cuda_graph_decode``; ``eager``
    otherwise.  ``device`` is a ``torch.device`` or a string (``"cuda:0"``); ``attention_capabilities``
    an :class:`~corerun.capabilities.AttentionCapabilities` (or a backend, whose ``capabilities`` is used).
    """
    caps = getattr(attention_capabilities, "capabilities", attention_capabilities)
    backend = f"attention backend '{attention_name}'" if attention_name else "the attention backend"
    device_type = _device_type(device)
    if device_type != "cuda":
        return "eager", f"device is {device_type}; CUDA graphs need a CUDA device"
    if not getattr(caps, "cuda_graph_decode", False):
        return "eager", f"{backend} does not declare its decode path CUDA-graph safe (cuda_graph_decode=False)"
    return "cuda", f"CUDA device and {backend} declares cuda_graph_decode"


__all__ = ["choose_graph_runner"]
