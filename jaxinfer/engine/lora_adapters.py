"""The engine's LoRA adapters: read from PEFT folders and placed on the device ready for a
slot (off the engine thread: the server prepares requests in worker threads), and the slots
they take (jaxinfer.engine.scheduling.lora_slots), so loading one into a slot at admission is
only a device write."""

from __future__ import annotations

import threading

import jax

from jaxinfer.config import EngineConfig
from jaxinfer.engine.scheduling.lora_slots import LoraSlots, SlotAdapter
from jaxinfer.layers.lora import slot_contents, target_shapes
from jaxinfer.lora_request import LoRARequest
from jaxinfer.model_loader.peft_adapter import load_peft_adapter


class LoraAdapters:
    def __init__(self, config: EngineConfig, runner):
        """`runner`: the ModelRunner whose slots (ModelRunner.lora) the adapters go into."""
        self.arch, self.dtype, self.max_rank = (
            config.model.arch,
            config.model.dtype,
            config.lora.max_rank,
        )
        self.shapes = target_shapes(self.arch)
        self.slots = LoraSlots(config.lora.max_loras, runner.load_lora)
        self._sharding = runner.partitioner.replicated
        self._lock = threading.Lock()
        self._requests: dict[int, LoRARequest] = {}  # by id
        self._adapters: dict[int, SlotAdapter] = {}
        self._readings = 0  # SlotAdapter.key of the next adapter read

    def get(self, request: LoRARequest) -> SlotAdapter:
        """The adapter `request` names, read and placed on first use (thread-safe); a
        ValueError for an adapter the engine cannot serve, or an id already used for another."""
        if not isinstance(request, LoRARequest):
            raise TypeError(f"expected a LoRARequest, got {type(request).__name__}")
        with self._lock:
            known = self._requests.get(request.id)
            placed = self._adapters.get(request.id)
        if known is not None:
            if known != request:
                raise ValueError(
                    f"LoRA id {request.id} is adapter {known.name!r} ({known.path}), not "
                    f"{request.name!r} ({request.path})"
                )
            return placed
        layers = self.arch.num_hidden_layers
        adapter = load_peft_adapter(request, self.shapes, layers, self.max_rank)
        contents = slot_contents(adapter.pairs, self.shapes, layers, self.max_rank, self.dtype)
        contents = jax.device_put(contents, self._sharding)
        with self._lock:
            if request.id in self._requests:  # another thread got here first
                return self.get(request)
            self._readings += 1
            placed = SlotAdapter(request.id, request.name, contents, self._readings)
            self._requests[request.id], self._adapters[request.id] = request, placed
        return placed

    def remove(self, adapter_id: int) -> bool:
        """Forgets an adapter (any thread): requests already admitted keep it; its slot is
        reused when another adapter needs one. False if it was not known."""
        with self._lock:
            self._adapters.pop(adapter_id, None)
            return self._requests.pop(adapter_id, None) is not None
