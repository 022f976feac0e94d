"""A GGUF file's header in one pass: metadata and tensor descriptions, with the tensors
left in the memory-mapped file until asked for.

``gguf.GGUFReader`` builds numpy views of every part of every metadata field; on
Gemma3's 262k-token vocabulary that takes about 25 s on a CPU core. Here metadata arrays
become Python values directly (strings in one loop, numbers through one numpy read),
and a tensor's data is a view made when it is read.

Layout (versions 2 and 3, little-endian): "GGUF", version u32, tensor count u64,
metadata count u64; each metadata entry is a key string, a value type u32 and the
value; each tensor entry is a name string, n_dims u32, n_dims u64 dims (fastest first),
a type u32 and a u64 offset into the data section, which starts at the first multiple
of ``general.alignment`` (default 32) after the header. A string is a u64 length and
UTF-8 bytes; an array is an item type u32, a u64 count and the items.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# value type -> (struct format, numpy dtype) of the fixed-size types
_FIXED = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}


class GGUFFormatError(ValueError):
    """The bytes do not follow the GGUF layout (truncated, corrupt, unsupported)."""


@dataclass
class TensorInfo:
    """One tensor of the file. ``dims`` in GGUF order (fastest first); ``tensor_type``
    a ``gguf.GGMLQuantizationType``; ``data`` the bytes at rest, shaped as gguf's reader
    shapes them (numpy order; block-quantized rows as bytes), for
    ``gguf.quants.dequantize``."""

    name: str
    dims: tuple[int, ...]
    tensor_type: Any
    start: int
    n_bytes: int
    _buffer: mmap.mmap

    @property
    def data(self) -> np.ndarray:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q  # deferred: see _parse

        native = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8,
                  Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}
        shape = tuple(reversed(self.dims))
        if self.tensor_type in native:
            dtype = native[self.tensor_type]
            count = self.n_bytes // np.dtype(dtype).itemsize
        else:
            block, size = GGML_QUANT_SIZES[self.tensor_type]
            dtype, count = np.uint8, self.n_bytes
            shape = (*shape[:-1], shape[-1] // block * size)
        return np.frombuffer(self._buffer, dtype, count, self.start).reshape(shape)


class GGUFHeader:
    """``fields``: metadata key -> value (scalars, str, lists); ``tensors`` in file
    order. Raises ``GGUFFormatError`` on bytes that do not parse or a file shorter than
    its tensors."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self._buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._parse()
        except GGUFFormatError:
            raise
        except (struct.error, UnicodeDecodeError, ValueError, KeyError) as e:
            raise GGUFFormatError(f"{type(e).__name__}: {e}") from e

    def _parse(self) -> None:
        # Deferred (0.15 s to import): only GGUF files need the gguf package.
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        buf = self._buffer
        if buf[:4] != _MAGIC:
            raise GGUFFormatError("bad magic")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in _VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} (supported: {_VERSIONS})")
        self._pos = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._u32())
        described = []
        for _ in range(n_tensors):
            name = self._string()
            dims = struct.unpack_from(f"<{self._u32()}Q", buf, self._pos)
            self._pos += 8 * len(dims)
            kind, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            described.append((name, dims, GGMLQuantizationType(kind), offset))
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, dims, kind, offset in described:
            block, size = GGML_QUANT_SIZES[kind]
            n_bytes = int(np.prod(dims, dtype=np.int64)) // block * size
            start = data_start + offset
            if start + n_bytes > len(buf):
                raise GGUFFormatError(f"tensor '{name}' runs past the end of the file "
                                      f"({start + n_bytes} > {len(buf)} bytes)")
            self.tensors.append(TensorInfo(name, dims, kind, start, n_bytes, buf))

    def _u32(self) -> int:
        (value,) = struct.unpack_from("<I", self._buffer, self._pos)
        self._pos += 4
        return value

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._buffer, self._pos)
        start = self._pos + 8
        if start + n > len(self._buffer):
            raise GGUFFormatError("a string runs past the end of the file")
        self._pos = start + n
        return self._buffer[start:start + n].decode("utf-8")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", self._buffer, self._pos)
            self._pos += 12
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item in _FIXED:
                dtype = np.dtype(_FIXED[item][1])
                values = np.frombuffer(self._buffer, dtype, count, self._pos)
                self._pos += count * dtype.itemsize
                return values.tolist()
            return [self._value(item) for _ in range(count)]  # arrays of arrays
        if kind not in _FIXED:
            raise GGUFFormatError(f"unknown metadata value type {kind}")
        fmt = _FIXED[kind][0]
        (value,) = struct.unpack_from(fmt, self._buffer, self._pos)
        self._pos += struct.calcsize(fmt)
        return value
