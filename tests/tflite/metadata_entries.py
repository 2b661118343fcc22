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
