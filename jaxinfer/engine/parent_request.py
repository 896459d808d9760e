"""A request for n > 1 samples: n child requests whose outputs are reported together."""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.request import Request
from jaxinfer.outputs import CompletionOutput, RequestOutput


@dataclasses.dataclass(eq=False)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    completions: list[CompletionOutput | None]  # the latest of each child, by index

    @property
    def finished(self) -> bool:
        return all(c is not None and c.finish_reason is not None for c in self.completions)

    def output(self) -> RequestOutput:
        """Every sample so far (those that have not produced a token yet are left out)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c for c in self.completions if c is not None],
            finished=self.finished,
            metrics=self.children[0].metrics,
            prompt_logprobs=self.children[0].prompt_logprobs,
        )
