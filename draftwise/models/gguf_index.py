"""The tensor table of a GGUF file (names, formats, shapes, where the bytes are), read without
its metadata.

Why not gguf-py's GGUFReader: it builds a numpy view for every part of every metadata field,
and a model's tokenizer is stored there as one string per token and per merge: 98k strings for
SmolLM2, 300k for Qwen2.5. Reading the tensor table through it took 5 s (SmolLM2) and 15 s
(Qwen2.5-Coder-0.5B) of every load (AMD EPYC, 2026-11-27), most of a load's time; draftwise
takes its config and tokenizer from the converted folder (loading.py) and needs only the table.
Here the metadata values are skipped, not parsed: the same file layout as gguf-py reads
(tests/test_gguf_index.py checks both agree on the packaged files), in about a tenth of a second.

Layout (GGUF versions 2 and 3, little-endian): magic "GGUF", uint32 version, uint64 tensor count,
uint64 metadata count; the metadata (key string, uint32 value type, value); the tensor infos
(name string, uint32 dimension count, uint64 per dimension, uint32 type, uint64 offset); then the
tensors' bytes from the next multiple of `general.alignment` (default 32). A string is a uint64
length and its bytes; an array a uint32 element type, a uint64 count and the elements.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
STRING, ARRAY = 8, 9
# Bytes of each fixed-size metadata value type (gguf's GGUFValueType numbering).
FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
UINT32 = 4
# struct formats of the scalar metadata types (read_index_and_metadata)
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (the message says where and why)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    format: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: columns (the fastest-varying dimension) first
    offset: int  # of its first byte in the file
    num_bytes: int


class _Cursor:
    def __init__(self, buffer, path: Path):
        self.buffer, self.path, self.at = buffer, path, 0

    def unpack(self, fmt: str) -> tuple[int, ...]:
        try:
            values = struct.unpack_from(fmt, self.buffer, self.at)
        except struct.error:
            raise GGUFFormatError(f"{self.path} ends inside its header (byte {self.at}): the file is truncated") from None
        self.at += struct.calcsize(fmt)
        return values

    def number(self, fmt: str) -> int:
        return self.unpack(fmt)[0]

    def string(self) -> bytes:
        length = self.number("<Q")
        if self.at + length > len(self.buffer):
            raise GGUFFormatError(f"{self.path}: a string at byte {self.at} runs past the end of the file (truncated?)")
        self.at += length
        return self.buffer[self.at - length:self.at]

    def skip_value(self, value_type: int) -> None:
        if value_type in FIXED_SIZES:
            self.at += FIXED_SIZES[value_type]
        elif value_type == STRING:
            length = self.number("<Q")  # read before `at` moves past it
            self.at += length
        elif value_type == ARRAY:
            element_type, count = self.unpack("<IQ")
            if count > len(self.buffer) - self.at:  # every element takes at least a byte
                raise GGUFFormatError(f"{self.path}: an array at byte {self.at} claims {count} elements, more "
                                      "than the file holds (truncated or not GGUF)")
            if element_type in FIXED_SIZES:
                self.at += FIXED_SIZES[element_type] * count
            elif element_type == STRING:
                buffer, at = self.buffer, self.at
                for _ in range(count):  # each element: uint64 length, then that many bytes
                    at += 8 + int.from_bytes(buffer[at:at + 8], "little")
                if at > len(buffer):
                    raise GGUFFormatError(f"{self.path}: a string array ends past the end of the file (truncated?)")
                self.at = at
            else:
                for _ in range(count):
                    self.skip_value(element_type)
        else:
            raise GGUFFormatError(f"{self.path}: unknown metadata value type {value_type} at byte {self.at}")


def read_index(path: Path) -> list[TensorEntry]:
    """Every tensor of the GGUF file at path; GGUFFormatError (a ValueError) naming the problem for a
    file that is not one."""
    path = Path(path)
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        if size == 0:
            raise GGUFFormatError(f"{path} is empty")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return _read(_Cursor(buffer, path))


def read_index_and_metadata(path: Path, wanted) -> tuple[list[TensorEntry], dict[str, object]]:
    """read_index's tensors and, from the same pass over the header, the scalar and string
    metadata values whose keys wanted(key) accepts (arrays are skipped), e.g.
    `llama.rope.scaling.type`, which transformers' GGUF reader leaves out."""
    found: dict[str, object] = {}
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        return _read(_Cursor(buffer, Path(path)), wanted, found), found


def _read(cursor: _Cursor, wanted=None, found: dict | None = None) -> list[TensorEntry]:
    path, size = cursor.path, len(cursor.buffer)
    if cursor.buffer[:4] != MAGIC:
        raise GGUFFormatError(f"{path} does not start with GGUF's magic bytes")
    cursor.at = 4
    version = cursor.number("<I")
    if version not in VERSIONS:
        order = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise GGUFFormatError(f"{path} is GGUF version {version}{order}; versions {VERSIONS} are supported")
    tensor_count, metadata_count = cursor.unpack("<QQ")
    alignment = 32
    for _ in range(metadata_count):
        key = cursor.string()
        value_type = cursor.number("<I")
        if key == b"general.alignment" and value_type == UINT32:
            alignment = cursor.number("<I")
            if alignment == 0 or alignment & (alignment - 1):
                raise GGUFFormatError(f"{path}: general.alignment {alignment} is not a power of two")
        elif wanted is not None and (value_type in SCALAR_FORMATS or value_type == STRING) and wanted(name := key.decode(
                "utf-8", errors="replace")):
            found[name] = (cursor.number(SCALAR_FORMATS[value_type]) if value_type in SCALAR_FORMATS
                           else cursor.string().decode("utf-8", errors="replace"))
        else:
            cursor.skip_value(value_type)
    infos = []
    for _ in range(tensor_count):
        name = cursor.string().decode("utf-8", errors="replace")
        num_dims = cursor.number("<I")
        shape = cursor.unpack(f"<{num_dims}Q")
        type_code, offset = cursor.unpack("<IQ")
        try:
            format = GGMLQuantizationType(type_code)
        except ValueError:
            raise GGUFFormatError(f"{path}: tensor {name} has unknown type {type_code}") from None
        infos.append((name, format, shape, offset))
    start = (cursor.at + alignment - 1) // alignment * alignment
    entries = []
    for name, format, shape, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[format]
        entry = TensorEntry(name, format, shape, start + offset, math.prod(shape) // block_size * type_size)
        if entry.offset + entry.num_bytes > size:
            raise GGUFFormatError(f"{path}: tensor {name} runs past the end of the file (truncated download?)")
        entries.append(entry)
    return entries
