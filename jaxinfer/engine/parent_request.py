"""A request for n > 1 samples: n child requests whose outputs are reported together."""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.request import Request
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling_params import RequestOutputKind


@dataclasses.dataclass(eq=False)
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    # The latest report of each child, by index (None before its first). With DELTA output,
    # the reports of one step, cleared once reported.
    completions: list[CompletionOutput | None]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_finished: int = 0
    reported_prompt_logprobs: bool = False

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.children)

    def update(self, child: Request, completion: CompletionOutput) -> None:
        self.completions[child.index] = completion
        if completion.finish_reason is not None:
            self.num_finished += 1

    def output(self) -> RequestOutput | None:
        """What to report after a step that updated some children, or None (a FINAL_ONLY
        request before its last child finishes). Samples without a report are left out."""
        if self.output_kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        prompt_logprobs = self.children[0].prompt_logprobs
        if self.output_kind is RequestOutputKind.DELTA:
            if self.reported_prompt_logprobs:
                prompt_logprobs = None
            self.reported_prompt_logprobs = True
        outputs = [c for c in self.completions if c is not None]
        if self.output_kind is RequestOutputKind.DELTA:
            self.completions = [None] * len(self.completions)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            metrics=self.children[0].metrics,
            prompt_logprobs=prompt_logprobs,
        )
