"""The engines jaxinfer is measured against, run on the same token-id prompts.

- HF transformers (torch, float32): static batches, each generating until its longest request is
  done (as static batching must), or one request at a time with a streamer for latency.
- llama.cpp through llama-cpp-python (the optional `llamacpp` extra), on the GGUF file the
  default model is converted from, with llama.cpp's own quantized CPU kernels: one sequence at a
  time, as that binding works. Each request starts from an empty KV cache (no prefix reuse).

Every run is greedy with end-of-sequence ignored, so each produces exactly the requested tokens.
A streaming run returns the wall-clock time at which each output token became available,
relative to the request's start: the first is the time to first token (TTFT), the gaps between
the rest are the inter-token latencies (ITL).
"""

from __future__ import annotations

import time
from pathlib import Path


def find_gguf(model_path: str | Path) -> Path:
    """The GGUF file the model folder was converted from (kept beside the converted files)."""
    found = sorted(Path(model_path).glob("*.gguf"))
    if len(found) != 1:
        raise FileNotFoundError(
            f"{model_path}: expected one .gguf file for the llama.cpp baseline, found "
            f"{[p.name for p in found]}; pass --gguf"
        )
    return found[0]


class HFPeer:
    """HF transformers in float32 on `threads` torch threads."""

    name = "hf"

    def __init__(self, model_path: str | Path, threads: int):
        import torch
        import transformers

        torch.set_num_threads(threads)
        self._torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32
        )
        self.model.eval()

    def throughput(
        self, prompts: list[list[int]], output_lens: list[int], batch_size: int
    ) -> float:
        """Seconds for all requests in static, left-padded batches of `batch_size`."""
        torch = self._torch
        pad_id = 0
        start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            longest_output = max(output_lens[first : first + batch_size])
            width = max(len(p) for p in batch)
            input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                self.model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    max_new_tokens=longest_output,
                    min_new_tokens=longest_output,
                    do_sample=False,
                    pad_token_id=pad_id,
                )
        return time.perf_counter() - start

    def stream(self, prompt: list[int], output_len: int) -> list[float]:
        """Seconds from the request's start to each output token."""
        from transformers.generation.streamers import BaseStreamer

        times: list[float] = []
        start = time.perf_counter()

        class Clock(BaseStreamer):
            prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:  # the first call carries the prompt
                    self.prompt_seen = True
                    return
                times.append(time.perf_counter() - start)

            def end(self):
                pass

        with self._torch.no_grad():
            self.model.generate(
                input_ids=self._torch.tensor([prompt]),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
                streamer=Clock(),
            )
        return times


class LlamaCppPeer:
    """llama.cpp (llama-cpp-python) on a GGUF file, `threads` threads, one sequence at a time."""

    name = "llamacpp"

    def __init__(self, gguf_path: str | Path, threads: int, context: int):
        try:
            from llama_cpp import Llama
        except ImportError as error:
            raise ImportError(
                "the llama.cpp baseline needs llama-cpp-python: pip install -e '.[llamacpp]' "
                "(it compiles llama.cpp, several minutes on 2 cores)"
            ) from error
        self.model = Llama(
            model_path=str(gguf_path),
            n_ctx=context,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def _generate(self, prompt: list[int], output_len: int, times: list[float] | None) -> None:
        self.model.reset()  # no prefix reuse from the previous request
        start = time.perf_counter()
        tokens = self.model.generate(prompt, top_k=1, temp=0.0, reset=True)
        for produced, _ in enumerate(tokens, start=1):
            if times is not None:
                times.append(time.perf_counter() - start)
            if produced == output_len:
                break

    def throughput(self, prompts: list[list[int]], output_lens: list[int]) -> float:
        """Seconds for all requests, one after another."""
        start = time.perf_counter()
        for prompt, output_len in zip(prompts, output_lens, strict=True):
            self._generate(prompt, output_len, None)
        return time.perf_counter() - start

    def stream(self, prompt: list[int], output_len: int) -> list[float]:
        times: list[float] = []
        self._generate(prompt, output_len, times)
        return times
