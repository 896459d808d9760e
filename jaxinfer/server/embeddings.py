"""POST /v1/embeddings: each input an embedding request on the engine's generation path
(jaxinfer.engine.execution.pooling), batched with everything else; vectors as float lists or
base64 (little-endian float32, as OpenAI's), `dimensions` keeping the first values before
normalizing (Matryoshka models)."""

from __future__ import annotations

import base64
from typing import Literal

import fastapi
import numpy as np
import pydantic

from jaxinfer.pooling_params import PoolingParams, check_dimensions
from jaxinfer.server import streams as engine_streams
from jaxinfer.server.errors import APIError
from jaxinfer.server.formatting import json_response
from jaxinfer.server.protocol import MAX_PROMPTS
from jaxinfer.server.serving import BAD_REQUEST, OpenAIServing
from jaxinfer.server.streams import Held


class EmbeddingRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = pydantic.Field(default=None, ge=1)
    user: str | None = None  # (the caller's own; nothing here reads it)

    def prompts(self) -> list[str | list[int]]:
        given = self.input
        if isinstance(given, str):
            return [given]
        if given and all(isinstance(x, int) for x in given):
            return [list(given)]
        if not given:
            raise ValueError("input must not be empty")
        if len(given) > MAX_PROMPTS:
            raise ValueError(f"a request takes at most {MAX_PROMPTS} inputs, got {len(given)}")
        if any(not x for x in given):
            raise ValueError("an input must not be empty")
        return list(given)


class EmbeddingsServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.pooling = serving.engine.engine.config.model.pooling_type

    async def create(self, body: EmbeddingRequest) -> fastapi.Response:
        serving = self.serving
        lora = serving.check_model(body.model, generates=False)
        try:
            prompts = body.prompts()
            pooling = PoolingParams(self.pooling, dimensions=body.dimensions)
            check_dimensions(pooling, serving.engine.engine.config.model.arch.hidden_size)
        except BAD_REQUEST as error:
            raise APIError(400, str(error)) from None
        held = Held(serving.limiter.take(len(prompts)))
        try:
            params = pooling.sampling_params()
            await serving._start(held, prompts, params, True, pooling=pooling, lora=lora)
            finals = await engine_streams.finals(held.streams)
        finally:
            held.release()

        def build() -> fastapi.Response:
            data = []
            for index, final in enumerate(finals):
                vector = final.embedding
                if body.encoding_format == "base64":
                    values = base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                else:
                    values = vector.astype(np.float32).tolist()
                data.append({"object": "embedding", "index": index, "embedding": values})
            tokens = sum(len(final.prompt_token_ids) for final in finals)
            usage = {"prompt_tokens": tokens, "total_tokens": tokens}
            model = serving.served_model_name
            return json_response({"object": "list", "data": data, "model": model, "usage": usage})

        return await serving.engine.run_in_worker(build)
