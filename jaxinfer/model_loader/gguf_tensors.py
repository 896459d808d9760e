"""The tensors of a GGUF file as memory-mapped byte arrays, found without reading its metadata
values: gguf.GGUFReader builds every metadata value (a vocabulary and merges list of 50k
strings each for the default model), 4.3 s here, where skipping them takes a few ms.

GGUF (v2, v3): a header (magic, version, tensor count, metadata count), the metadata (key,
type, value), the tensor infos (name, dims fastest first, type, offset), then the tensor data
from the next multiple of `general.alignment` bytes (gguf's constants and quant sizes are used).
"""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import gguf
import numpy as np

_SCALARS = {  # value type -> struct format
    gguf.GGUFValueType.UINT8: "B",
    gguf.GGUFValueType.INT8: "b",
    gguf.GGUFValueType.UINT16: "H",
    gguf.GGUFValueType.INT16: "h",
    gguf.GGUFValueType.UINT32: "I",
    gguf.GGUFValueType.INT32: "i",
    gguf.GGUFValueType.FLOAT32: "f",
    gguf.GGUFValueType.BOOL: "?",
    gguf.GGUFValueType.UINT64: "Q",
    gguf.GGUFValueType.INT64: "q",
    gguf.GGUFValueType.FLOAT64: "d",
}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # gguf.GGMLQuantizationType name: "Q4_1", "F32", ...
    shape: tuple[int, ...]  # numpy order (rows first)
    data: np.ndarray  # u8[rows, bytes per row], a view of the memory-mapped file
    offset: int = 0  # where the data starts in the file


class _Cursor:
    def __init__(self, data: np.ndarray):
        self.data, self.offset = data, 0

    def read(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        size = self.read("Q")
        text = bytes(self.data[self.offset : self.offset + size]).decode("utf-8")
        self.offset += size
        return text

    def skip_string(self) -> None:
        self.offset += 8 + struct.unpack_from("<Q", self.data, self.offset)[0]

    def value(self, kind: int, keep: bool):
        """The metadata value of type `kind` (kept only if asked; arrays are skipped)."""
        if kind == gguf.GGUFValueType.STRING:
            if keep:
                return self.string()
            return self.skip_string()
        if kind == gguf.GGUFValueType.ARRAY:
            item, count = self.read("IQ")
            if item in _SCALARS:
                self.offset += count * struct.calcsize("<" + _SCALARS[item])
            else:
                for _ in range(count):
                    self.value(item, keep=False)
            return None
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata type {kind}")
        return self.read(_SCALARS[kind])


def read_tensors(path: Path) -> dict[str, GGUFTensor]:
    """name -> tensor of the GGUF file at `path` (a ValueError if it is not one)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    cursor.offset = 4
    version, num_tensors, num_kv = cursor.read("IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3)")
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for _ in range(num_kv):
        key = cursor.string()
        value = cursor.value(cursor.read("I"), keep=key == "general.alignment")
        if key == "general.alignment":
            alignment = int(value)
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = [cursor.read("Q") for _ in range(cursor.read("I"))]
        kind, offset = cursor.read("IQ")
        infos.append((name, gguf.GGMLQuantizationType(kind), tuple(reversed(dims)), offset))
    start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, kind, shape, offset in infos:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        row_bytes = shape[-1] // block_size * block_bytes
        begin = start + offset
        view = data[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = GGUFTensor(name, kind.name, shape, view, begin)
    return tensors
