"""The built-in LoRA kernels' capabilities, as data importable without torch (the registry lists them)."""

from __future__ import annotations

from corerun.plugin.capabilities import LoRAKernelCapabilities

TORCH_KERNEL = LoRAKernelCapabilities(graph_safe=True)
GROUPED_KERNEL = LoRAKernelCapabilities(grouped=True)  # reads each slot's token count on the host: not graph safe
