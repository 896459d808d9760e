"""LoRA adapters over HTTP: the adapters a server serves are models of their own (a request
names one in its `model` field; /v1/models lists them), and with runtime updates on
(--enable_lora_runtime_updates) POST /v1/load_lora_adapter and /v1/unload_lora_adapter add and
remove them, behind the API key like all of /v1."""

from __future__ import annotations

import threading

import fastapi
import pydantic

from jaxinfer.lora_request import LoRARequest
from jaxinfer.server.errors import APIError
from jaxinfer.server.protocol import _Body
from jaxinfer.server.serving import OpenAIServing


class LoadLoraRequest(_Body):
    lora_name: str = pydantic.Field(min_length=1, max_length=256)
    lora_path: str = pydantic.Field(min_length=1, max_length=4096)


class UnloadLoraRequest(_Body):
    lora_name: str = pydantic.Field(min_length=1, max_length=256)


class LoraModels:
    """The adapters served, by model name, with the engine ids they are given (each new
    adapter a fresh id, never reused)."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self._lock = threading.Lock()
        self._next_id = 1

    def add(self, name: str, path: str) -> LoRARequest:
        """Reads the adapter (a ValueError if the engine cannot serve it) and serves it."""
        serving = self.serving
        loras = serving.engine.engine.loras
        if loras is None:
            raise ValueError("this server's engine serves no LoRA adapters (enable_lora)")
        with self._lock:
            if name == serving.served_model_name or name in serving.loras:
                raise ValueError(f"a model named {name!r} is already served")
            request, self._next_id = LoRARequest(name, self._next_id, path), self._next_id + 1
        loras.get(request)  # read and placed now: requests never wait on the files
        with self._lock:
            if name in serving.loras:
                loras.remove(request.id)
                raise ValueError(f"a model named {name!r} is already served")
            serving.loras[name] = request
        return request

    def remove(self, name: str) -> None:
        """Stops serving an adapter (requests already running keep it); a KeyError if it is not
        served."""
        with self._lock:
            request = self.serving.loras.pop(name)
        self.serving.engine.engine.loras.remove(request.id)

    def cards(self, created: int = 0) -> list[dict]:
        """/v1/models' entries of the adapters."""
        base = self.serving.served_model_name
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "jaxinfer",
                "root": request.path,
                "parent": base,
                "max_model_len": self.serving.max_model_len,
            }
            for name, request in sorted(self.serving.loras.items())
        ]


def install_lora_routes(app: fastapi.FastAPI, models: LoraModels) -> None:
    """The load and unload endpoints (only where runtime updates are on)."""
    engine = models.serving.engine

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest):
        try:
            await engine.run_in_worker(models.add, body.lora_name, body.lora_path)
        except ValueError as error:
            raise APIError(400, str(error)) from None
        return fastapi.responses.PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' added successfully."
        )

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest):
        try:
            models.remove(body.lora_name)
        except KeyError:
            raise APIError(
                404, f"no LoRA adapter named {body.lora_name!r}", "not_found_error"
            ) from None
        return fastapi.responses.PlainTextResponse(
            f"Success: LoRA adapter '{body.lora_name}' removed successfully."
        )
