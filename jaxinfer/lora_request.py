"""LoRARequest: which LoRA adapter a request runs with (LLM.generate's lora_request)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, integer id and PEFT folder (adapter_config.json and
    adapter_model.safetensors). The id names the adapter inside the engine: its device slot
    and its prefix-cache entries; one id is one adapter (another path under a used id is an
    error)."""

    name: str
    id: int
    path: str

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a LoRA adapter's name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.id, int) or isinstance(self.id, bool) or self.id < 1:
            raise ValueError(f"a LoRA adapter's id must be a positive integer, got {self.id!r}")
        object.__setattr__(self, "path", str(self.path))
