"""The engines jaxinfer is measured against, run on the same token-id prompts.

- HF transformers (torch, float32): static batches, each generating until its longest request is
  done (as static batching must), or one request at a time with a streamer for latency.
- llama.cpp through llama-cpp-python (the optional `llamacpp` extra), on the GGUF file the
  default model is converted from, with llama.cpp's own quantized CPU kernels: one sequence at a
  time, as that binding works. Each request starts from an empty KV cache (no prefix reuse).
- llama-server, llama.cpp's own server (the same llama.cpp as the binding, built by `make
  bench`), on the same file with `-np` slots: continuous batching, every request sent at once
  over HTTP with prompt caching off.

Every run is greedy with end-of-sequence ignored, so each produces exactly the requested tokens.
A streaming run returns the wall-clock time at which each output token became available,
relative to the request's start: the first is the time to first token (TTFT), the gaps between
the rest are the inter-token latencies (ITL).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
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


def llama_server_binary() -> Path:
    """llama-server: on PATH, or in this environment's bin (where `make bench` puts it)."""
    found = shutil.which("llama-server") or Path(sys.prefix) / "bin" / "llama-server"
    if not Path(found).exists():
        raise FileNotFoundError("no llama-server: `make bench` builds it into the venv's bin")
    return Path(found)


class LlamaServerPeer:
    """llama-server on a GGUF file with `slots` parallel sequences (continuous batching) and
    `threads` threads, driven over HTTP on this machine."""

    name = "llamaserver"

    def __init__(self, gguf_path: str | Path, threads: int, context: int, slots: int):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        # the server's output, read back if it fails to start; closed with the peer
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="llama-server-")  # noqa: SIM115
        command = [
            str(llama_server_binary()),
            *("-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(self.port)),
            *("-t", str(threads), "-tb", str(threads), "-np", str(slots)),
            *("-c", str(context * slots), "-b", "512", "--no-warmup"),
        ]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        self.slots = slots
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                self.close()
                raise RuntimeError(f"llama-server did not start:\n{self.log.read()[-2000:]}")
            time.sleep(0.5)

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _request(self, prompt: list[int], output_len: int, stream: bool):
        body = {
            "prompt": prompt,
            "n_predict": output_len,
            "temperature": 0.0,
            "top_k": 1,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": stream,
        }
        request = urllib.request.Request(
            self._url("/completion"),
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        return urllib.request.urlopen(request, timeout=3600)

    def _complete(self, prompt: list[int], output_len: int) -> None:
        with self._request(prompt, output_len, stream=False) as response:
            produced = json.load(response)["tokens_predicted"]
        if produced != output_len:
            raise RuntimeError(f"llama-server produced {produced} tokens, not {output_len}")

    def throughput(self, prompts: list[list[int]], output_lens: list[int]) -> float:
        """Seconds for all requests, sent at once (the server runs `slots` at a time)."""
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            list(pool.map(self._complete, prompts, output_lens))
        return time.perf_counter() - start

    def stream(self, prompt: list[int], output_len: int) -> list[float]:
        times: list[float] = []
        start = time.perf_counter()
        with self._request(prompt, output_len, stream=True) as response:
            for line in response:
                if line.startswith(b"data: ") and not json.loads(line[6:]).get("stop"):
                    times.append(time.perf_counter() - start)
        return times

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()
