"""``LoRARequest``: the adapter a request runs under (vLLM's shape: name, integer id, PEFT folder)."""

from __future__ import annotations

from dataclasses import dataclass

from corerun.errors import RequestError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A PEFT adapter, named by ``lora_name``, identified by ``lora_int_id`` (an integer >= 1, unique per
    adapter: two requests with the same id share one loaded copy and one device slot) and read from the
    folder ``lora_path`` (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise RequestError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise RequestError(
                f"LoRARequest.lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path.strip():
            raise RequestError(f"LoRARequest.lora_path must be the adapter's folder, got {self.lora_path!r}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
