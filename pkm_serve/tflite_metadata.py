"""Metadata of TFLite model files read without a schema or flatbuffers module (tflite_runtime
ships neither): the names of the entries, and how many SignatureDefs TF Serving's
signature_defs_metadata holds."""

from __future__ import annotations

import struct
from typing import List, Optional

_MODEL_METADATA_FIELD = 6   # Model.metadata: [Metadata {name: string, buffer: uint}] (schema.fbs)
_MODEL_BUFFERS_FIELD = 4    # Model.buffers: [Buffer {data: [ubyte], ...}]
SIGNATURE_DEFS_METADATA = "signature_defs_metadata"   # TF Serving's SignatureDefs of a .tflite


def _flatbuffer_reader(model_bytes):
    """(u32(at), field(table, index)) over a flatbuffer's bytes: field gives the position of a
    table's field, or None where the table leaves it out."""
    def u32(at):
        return struct.unpack_from("<I", model_bytes, at)[0]

    def field(table, index):
        vtable = table - struct.unpack_from("<i", model_bytes, table)[0]
        if vtable < 0:   # (struct would read a negative position from the end)
            raise IndexError(vtable)
        vtable_size = struct.unpack_from("<H", model_bytes, vtable)[0]
        if vtable_size < 4:   # no vtable (its two sizes alone take 4): a zero run read as tables was a slow loop
            raise IndexError(f"a vtable of {vtable_size} bytes at {vtable}")
        if 4 + 2 * index + 2 > vtable_size:
            return None
        offset = struct.unpack_from("<H", model_bytes, vtable + 4 + 2 * index)[0]
        return table + offset if offset else None
    return u32, field


def _metadata_entries(model_bytes) -> List[tuple]:
    """[(name, buffer index)] of the model's metadata entries (an entry that leaves its buffer
    out names buffer 0, the field's default); [] where the flatbuffer has none or cannot be
    read that far."""
    u32, field = _flatbuffer_reader(model_bytes)
    try:
        entries = field(u32(0), _MODEL_METADATA_FIELD)
        if entries is None:
            return []
        vector = entries + u32(entries)
        if vector + 4 + 4 * u32(vector) > len(model_bytes):
            raise IndexError(f"{u32(vector)} entries past the end")
        found = []
        for i in range(u32(vector)):
            entry = vector + 4 + 4 * i
            entry += u32(entry)
            name, buffer = field(entry, 0), field(entry, 1)
            if name is not None:
                name += u32(name)
                found.append((bytes(model_bytes[name + 4:name + 4 + u32(name)]).decode("utf-8", "replace"),
                              0 if buffer is None else u32(buffer)))
        return found
    except (struct.error, IndexError):
        return []


def metadata_names(model_bytes) -> List[str]:
    """The names of the model's metadata entries, read without a schema module (tflite_runtime
    ships none); [] where the flatbuffer has none or cannot be read that far."""
    return [name for name, _ in _metadata_entries(model_bytes)]


_FLEXBUFFER_MAP = 9   # flexbuffers' FBT_MAP


def no_data_reason(offset: int) -> str:
    """Why the signature_defs_metadata entry's buffer gives no SignatureDefs where it has no
    data vector; `offset` its Buffer.offset (schema.fbs: > 1 places the bytes after the
    flatbuffer, as the converter writes models over 2 GB)."""
    if offset > 1:
        return (f"its buffer holds no data: its bytes are stored by offset ({offset}) outside the flatbuffer, "
                "where TF Serving's GetSignatureDefMap does not read them (it reads the buffer's data only)")
    return "its buffer holds no data"


def signature_defs_metadata_size(model_bytes) -> Optional[int]:
    """How many SignatureDefs the model's signature_defs_metadata holds (a FlexBuffer map
    {key: serialized SignatureDef}), None without the entry; read without a schema or
    flatbuffers module. An empty map is no SignatureDef: TF Serving then serves the model
    as one without the entry. ValueError where the entry is not such a map (a server's
    load refuses it: "Invalid SignatureDefs found")."""
    entry = [buffer for name, buffer in _metadata_entries(model_bytes) if name == SIGNATURE_DEFS_METADATA]
    if not entry:
        return None
    u32, field = _flatbuffer_reader(model_bytes)
    try:
        buffers = field(u32(0), _MODEL_BUFFERS_FIELD)
        vector = buffers + u32(buffers)
        if entry[0] >= u32(vector):
            raise IndexError(f"buffer {entry[0]} of {u32(vector)}")
        table = vector + 4 + 4 * entry[0]
        table += u32(table)
        data = field(table, 0)
        if data is None:
            offset = field(table, 1)
            raise IndexError(no_data_reason(0 if offset is None else struct.unpack_from("<Q", model_bytes, offset)[0]))
        data += u32(data)
        if data + 4 + u32(data) > len(model_bytes):   # (a slice would stop at the end: a truncated file)
            raise IndexError(f"its {u32(data)} bytes run past the file's end")
        blob = bytes(model_bytes[data + 4:data + 4 + u32(data)])
        if len(blob) < 3:
            raise IndexError(f"{len(blob)} bytes")
        root_width, packed = blob[-1], blob[-2]
        if packed >> 2 != _FLEXBUFFER_MAP or root_width not in (1, 2, 4, 8):
            raise ValueError(f"its root is flexbuffer type {packed >> 2}, not a map")
        root = len(blob) - 2 - root_width
        values = root - int.from_bytes(blob[root:root + root_width], "little")
        width = 1 << (packed & 3)
        if not width <= values <= root:
            raise IndexError(f"a map at {values}")
        return int.from_bytes(blob[values - width:values], "little")
    except (struct.error, IndexError, TypeError, ValueError) as e:
        raise ValueError(f"Invalid SignatureDefs found in TfLite model (its {SIGNATURE_DEFS_METADATA}): "
                         f"{type(e).__name__}: {e}") from None
