"""``corerun bench --lora N``: the workload's requests spread over N random adapters, against the same
engine serving the base model alone (its LoRA layers switched off), run in turn (corerun.bench.on_off).

The adapters are random PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``) of rank
``max_lora_rank`` on every linear layer the model has, written to a temporary folder: what they compute
does not matter, only what they cost.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from corerun.lora.request import LoRARequest


def write_random_adapters(engine: Any, folder: Path, count: int, rank: int, seed: int = 0) -> list[LoRARequest]:
    """``count`` random adapters of rank ``rank`` for ``engine``'s model, on every layer LoRA can target."""
    from safetensors.torch import save_file

    targets = engine.runner.lora.targets
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        tensors: dict[str, torch.Tensor] = {}
        for t in targets.values():
            whole = len(t.slices) > 1 and all(s.module in ("q", "k", "v", "gate", "up") for s in t.slices)  # merged in the checkpoint
            parts = [(t.leaf, sum(s.full for s in t.slices))] if whole else [(s.module, s.full) for s in t.slices]
            for module, rows in parts:
                key = f"base_model.model.{t.parent}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, t.in_full, generator=g) / t.in_full ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(rows, rank, generator=g) / rank ** 0.5
        path = folder / f"adapter-{i}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        modules = sorted({k.split(".lora_")[0].rsplit(".", 1)[1] for k in tensors})
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none"}))
        out.append(LoRARequest(f"bench-{i}", i + 1, str(path)))
    return out


class AdapterRuns:
    """``llm`` as ``run_on_off`` drives it: on, each request runs under ``adapters[i % N]``; off, the LoRA
    layers are switched off and every request runs on the base model."""

    def __init__(self, llm: Any, adapters: list[LoRARequest]) -> None:
        self.llm, self.engine, self.adapters, self.on = llm, llm.engine, adapters, True

    def switch(self, on: bool) -> None:
        self.on = on
        self.engine.runner.lora.state.enabled = on

    def generate(self, prompts: list[Any], params: Any, use_tqdm: bool = False) -> Any:
        n = len(self.adapters)
        loras = [self.adapters[i % n] for i in range(len(prompts))] if self.on else None
        return self.llm.generate(prompts, params, use_tqdm=use_tqdm, lora_request=loras)


def adapters_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="corerun-bench-lora-"))
