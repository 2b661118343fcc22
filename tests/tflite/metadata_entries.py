"""A .tflite model with a metadata entry added (TF Serving keeps a model's SignatureDefs in one
named signature_defs_metadata), for the tests of the readers of that entry."""
import numpy as np

from pkm_serve import tflite


def with_metadata_entry(model_bytes, name, blob) -> bytes:
    """model_bytes plus a metadata entry `name` whose buffer holds `blob`."""
    import flatbuffers
    schema = tflite.flatbuffer_schema()
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    buffer = schema.BufferT()
    buffer.data = np.frombuffer(blob, np.uint8)
    m.buffers.append(buffer)
    entry = schema.MetadataT()
    entry.name, entry.buffer = name, len(m.buffers) - 1
    m.metadata = (m.metadata or []) + [entry]
    b = flatbuffers.Builder(len(model_bytes) + len(blob) + 4096)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def with_metadata_stored_by_offset(model_bytes, name, keep_inline) -> bytes:
    """model_bytes with metadata entry `name`'s bytes also (keep_inline) or only stored after the
    flatbuffer, its Buffer's offset/size giving where (schema.fbs, as for models over 2 GB)."""
    import flatbuffers
    schema = tflite.flatbuffer_schema()
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(model_bytes), 0))
    (buffer,) = [m.buffers[e.buffer] for e in m.metadata if e.name == name.encode()]
    blob = bytes(bytearray(buffer.data))
    buffer.data = buffer.data if keep_inline else None

    def packed(offset):
        buffer.offset, buffer.size = offset, len(blob)
        b = flatbuffers.Builder(len(model_bytes) + 4096)
        b.Finish(m.Pack(b), file_identifier=b"TFL3")
        return bytes(b.Output())
    size = len(packed(1 << 40))   # (the offset's value does not change the flatbuffer's size)
    start = size + (-size % 16)
    return packed(start).ljust(start, b"\0") + blob
