"""A GGUF model's weights read in place: the projections (a MoE layer's experts too), the
embedding and the LM head kept in the file's own blocks (jaxinfer.layers.weights.GGUFWeight,
multiplied by the block kernel of cpu_kernels.gguf_matmul), everything else (norms, biases, a
MoE router) dequantized to float.

Each weight kind is one buffer over the layers (u8[L, B], 64-byte aligned so that placing it
on the CPU device does not copy it), filled by reading the file's bytes straight into it: the
file is read once, never memory-mapped whole and never expanded to float32. Rows are reordered
where the engine's layout asks (QKV fused by KV head; Q and K unpermuted where llama.cpp
permuted them), which moves whole rows of blocks and changes no byte of them. Where the int8
mode runs on AVX-512 VNNI, runs in reference.INTERLEAVE's formats are laid out 16 rows at a
time instead (cpu_kernels/gguf_matmul/interleaved.h: the same values, read through a
tensor-sized scratch).

Supported blocks: cpu_kernels.gguf_matmul.reference.FORMATS. A weight kind with a tensor in
another type (F16, F32, Q2_K, ...) in any layer is read as a float weight instead, and named
in the result (`float_weights`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from cpu_kernels.gguf_matmul.reference import FORMATS, INTERLEAVE, LAYOUTS, X16, row_bytes
from jaxinfer.arch_config import LlamaConfig
from jaxinfer.layers.weights import GGUFWeight
from jaxinfer.model_loader.gguf_convert import GGUFTensorReader, unpermute_qk
from jaxinfer.model_loader.gguf_tensors import GGUFTensor, read_tensors
from jaxinfer.model_loader.safetensors_loader import params_from_reader
from jaxinfer.models.families import family_for_architecture

ALIGNMENT = 64
_INTERLEAVE_ROWS = 1024  # rows interleaved at once (a multiple of the tiles' 16)


def aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """u8[shape], its first byte on a multiple of ALIGNMENT."""
    size = int(np.prod(shape))
    raw = np.empty(size + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + size].reshape(shape)


def _read(fd: int, tensor: GGUFTensor, out: np.ndarray) -> None:
    """The tensor's bytes into `out` (contiguous, its size), by positioned reads."""
    view = memoryview(out.reshape(-1))
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], tensor.offset + done)
        if got <= 0:
            raise ValueError(f"{tensor.name}: the file ends inside the tensor")
        done += got


@dataclasses.dataclass(frozen=True)
class _Part:
    """Rows of one tensor: which rows, in the order the weight takes them."""

    tensor: GGUFTensor
    rows: np.ndarray | None = None  # i64[R], None for all in order


class _File:
    def __init__(self, path: Path, config: LlamaConfig):
        self.path = path
        self.tensors = read_tensors(path)
        self.config = config
        self.fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self.fd)

    def supported(self, names: list[str]) -> bool:
        """Whether every tensor is there, in a block format the kernel reads."""
        for name in names:
            t = self.tensors.get(name)
            if t is None or t.type_name not in FORMATS:
                return False
            if t.shape[-1] % FORMATS[t.type_name][1]:
                return False
        return True

    def rows(self, part: _Part) -> tuple[str, np.ndarray]:
        """(format, u8[R, row bytes]) of a part, read from the file."""
        t = part.tensor
        raw = np.empty(t.data.shape, np.uint8)
        _read(self.fd, t, raw)
        return t.type_name, raw if part.rows is None else raw[part.rows]

    def weight(
        self, layers: list[list[_Part]], out: tuple[int, ...], k: int, interleave: bool = False
    ) -> GGUFWeight:
        """The GGUFWeight [L, ...] whose layer i is the rows of layers[i]'s parts, in order.
        interleave: runs of whole tiles of 16 rows are laid out interleaved where their format
        has such a layout (reference.INTERLEAVE), for the kernel's integer path on AVX-512
        VNNI."""
        runs = [_runs(parts, k, interleave) for parts in layers]
        sizes = [sum(run.nbytes for run in layer) for layer in runs]
        data = aligned_empty((len(layers), max(sizes)))
        for i, size in enumerate(sizes):
            data[i, size:] = 0  # the padding of a shorter layer
        table = np.zeros((len(layers), max(len(r) for r in runs), 3), np.int32)
        for i, layer in enumerate(runs):
            offset = 0
            for s, run in enumerate(layer):
                self._fill(run, data[i, offset : offset + run.nbytes])
                table[i, s] = (LAYOUTS[run.layout][0], run.count, offset)
                offset += run.nbytes
        return GGUFWeight(data, table, np.arange(len(layers), dtype=np.int32), out, k)

    def _fill(self, run: _Run, out: np.ndarray) -> None:
        """A run's bytes into `out`: a whole tensor straight into place, rows picked from a
        tensor through a copy, an interleaved run through its file layout."""
        if run.layout != run.fmt:  # interleaved a chunk of tiles at a time: little scratch
            raw = np.concatenate([self.rows(part)[1] for part in run.parts])
            size = row_bytes(run.layout, run.k)
            for start in range(0, run.count, _INTERLEAVE_ROWS):
                tiles = INTERLEAVE[run.layout](raw[start : start + _INTERLEAVE_ROWS])
                out[start * size : start * size + tiles.nbytes] = tiles.reshape(-1)
            return
        offset = 0
        for part in run.parts:
            if part.rows is None:
                size = part.tensor.data.shape[0] * row_bytes(run.fmt, run.k)
                _read(self.fd, part.tensor, out[offset : offset + size])
            else:
                raw = self.rows(part)[1]
                size = raw.nbytes
                out[offset : offset + size] = raw.reshape(-1)
            offset += size


@dataclasses.dataclass(frozen=True)
class _Run:
    """Consecutive parts of one format: one segment of the weight's table."""

    fmt: str  # the file's format
    layout: str  # how the kernel reads it: fmt, or an interleaved layout of it
    parts: tuple[_Part, ...]
    count: int  # rows
    k: int

    @property
    def nbytes(self) -> int:
        return self.count * row_bytes(self.layout, self.k)


def _runs(parts: list[_Part], k: int, interleave: bool) -> list[_Run]:
    grouped: list[list[_Part]] = []
    for part in parts:
        if grouped and grouped[-1][0].tensor.type_name == part.tensor.type_name:
            grouped[-1].append(part)
        else:
            grouped.append([part])
    runs = []
    for group in grouped:
        fmt = group[0].tensor.type_name
        count = sum(p.tensor.data.shape[0] if p.rows is None else len(p.rows) for p in group)
        tiled = interleave and f"{fmt}_X16" in INTERLEAVE and count % X16 == 0
        runs.append(_Run(fmt, f"{fmt}_X16" if tiled else fmt, tuple(group), count, k))
    return runs


def _qkv_parts(file: _File, config: LlamaConfig, layer: int, permuted: bool) -> list[_Part]:
    """Layer `layer`'s Q, K, V rows in the fused order [K, G + 2, D]: each KV head's query
    heads, then its key, then its value (jaxinfer.model_loader.safetensors_loader.fuse_qkv)."""
    D, K = config.head_dim, config.num_key_value_heads
    G = config.num_attention_heads // K
    tensors = [file.tensors[f"blk.{layer}.attn_{x}.weight"] for x in "qkv"]

    def order(rows: int, heads: int) -> np.ndarray:
        numbers = np.arange(rows)
        return unpermute_qk(numbers, heads) if permuted else numbers

    q_rows = order(K * G * D, K * G).reshape(K, G * D)
    k_rows = order(K * D, K).reshape(K, D)
    v_rows = np.arange(K * D).reshape(K, D)
    parts = []
    for head in range(K):
        parts += [
            _Part(tensors[0], q_rows[head]),
            _Part(tensors[1], k_rows[head]),
            _Part(tensors[2], v_rows[head]),
        ]
    return parts


def _expert_parts(file: _File, names: list[str], layer: int, expert: int) -> list[_Part]:
    """Expert `expert`'s rows of layer `layer`'s packed expert tensors ([X, rows, K] each), in
    order: each a view of its bytes in the file, read alone."""
    parts = []
    for name in names:
        t = file.tensors[name.format(layer)]
        rows = t.data.shape[0] // t.shape[0]
        first = expert * rows
        view = dataclasses.replace(
            t,
            shape=t.shape[1:],
            data=t.data[first : first + rows],
            offset=t.offset + first * t.data.shape[1],
        )
        parts.append(_Part(view))
    return parts


def load_gguf_params(
    path: Path, config: LlamaConfig, dtype, interleave: bool = False
) -> tuple[dict, list[str]]:
    """(the parameter tree of a model from its GGUF file, the names of the weights kept in
    blocks): the projections (a MoE layer's experts and shared expert too), the embedding and
    the LM head as GGUFWeights where every layer's tensors are in formats the block kernel
    reads, the rest (norms, biases, a MoE router) as the float arrays of
    jaxinfer.model_loader.safetensors_loader.params_from_reader. interleave: the blocks laid out
    16 rows at a time where they can be (ResolvedOptions.gguf_interleaved)."""
    family = family_for_architecture(config.architecture)
    file = _File(path, config)
    try:
        L, E, D = config.num_hidden_layers, config.hidden_size, config.head_dim
        K = config.num_key_value_heads
        G = config.num_attention_heads // K
        I = config.dense_intermediate_size  # noqa: E741
        ffn = "ffn_{}" if config.moe is None else "ffn_{}_shexp"  # the dense FFN's, or shared
        kinds = {
            "qkv_proj": ([f"blk.{{}}.attn_{x}.weight" for x in "qkv"], (K, G + 2, D), E),
            "o_proj": (["blk.{}.attn_output.weight"], (E,), config.q_size),
        }
        if I:
            gate_up = [f"blk.{{}}.{ffn.format(x)}.weight" for x in ("gate", "up")]
            kinds["gate_up_proj"] = (gate_up, (2, I), E)
            kinds["down_proj"] = ([f"blk.{{}}.{ffn.format('down')}.weight"], (E,), I)
        blocks: dict = {"layers": {}}
        for name, (patterns, out, k) in kinds.items():
            names = [p.format(i) for i in range(L) for p in patterns]
            if not file.supported(names):
                continue
            if name == "qkv_proj":
                layers = [_qkv_parts(file, config, i, family.gguf_qk_permuted) for i in range(L)]
            else:
                layers = [[_Part(file.tensors[p.format(i)]) for p in patterns] for i in range(L)]
            blocks["layers"][name] = file.weight(layers, out, k, interleave)
        if config.moe is not None:
            blocks["layers"].update(_experts(file, config, interleave))
        V = config.vocab_size
        heads = {"embed": "token_embd.weight"}
        if not config.tie_word_embeddings:
            heads["lm_head"] = "output.weight"
        for name, tensor in heads.items():
            if file.supported([tensor]):
                blocks[name] = file.weight([[_Part(file.tensors[tensor])]], (V,), E, interleave)
    finally:
        file.close()
    kept = [*blocks["layers"], *(n for n in blocks if n != "layers")]
    reader = GGUFTensorReader(path, family, config.num_attention_heads, K)
    params = params_from_reader(reader, config, dtype, skip=frozenset(kept))
    params["layers"].update(blocks.pop("layers"))
    params.update(blocks)
    return params, kept


def _experts(file: _File, config: LlamaConfig, interleave: bool) -> dict[str, GGUFWeight]:
    """A MoE model's experts as GGUFWeights of X experts per layer (layer l's expert x at
    l * X + x), from the packed tensors llama.cpp writes (ffn_{gate,up,down}_exps [X, rows,
    K]): gate then up rows [2, I] over E, down [E] over I."""
    L, E = config.num_hidden_layers, config.hidden_size
    X, I = config.moe.num_experts, config.moe.intermediate_size  # noqa: E741
    kinds = {
        "experts_gate_up": (
            ["blk.{}.ffn_gate_exps.weight", "blk.{}.ffn_up_exps.weight"],
            (2, I),
            E,
        ),
        "experts_down": (["blk.{}.ffn_down_exps.weight"], (E,), I),
    }
    out = {}
    for name, (patterns, shape, k) in kinds.items():
        if not file.supported([p.format(i) for i in range(L) for p in patterns]):
            continue
        layers = [_expert_parts(file, patterns, i, x) for i in range(L) for x in range(X)]
        weight = file.weight(layers, shape, k, interleave)
        out[name] = dataclasses.replace(weight, layer=np.arange(L, dtype=np.int32), groups=X)
    return out
