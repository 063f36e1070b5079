"""Copies of a GGUF file with some of its tensors or metadata changed, for tests (gguf-py's reader
and writer, as its gguf_new_metadata script copies a file)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def copy_gguf(source: Path, path: Path,
              tensor: Callable[[str, np.ndarray, object], tuple[np.ndarray, object]] = lambda name, data, fmt: (data, fmt),
              metadata: Callable[[object, str], None] = lambda writer, arch: None) -> None:
    """source's metadata and tensors into path: each tensor through tensor(name, data, format) ->
    (data, format); metadata(writer, architecture) adds keys after the copied ones."""
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(path, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    metadata(writer, arch)
    tensors = []
    for entry in reader.tensors:
        data, format = tensor(entry.name, np.asarray(entry.data), entry.tensor_type)
        tensors.append(data)
        writer.add_tensor_info(entry.name, data.shape, data.dtype, data.nbytes, format)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data)
    writer.close()
