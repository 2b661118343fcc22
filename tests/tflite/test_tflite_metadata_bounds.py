"""pkm_serve.tflite_metadata's flatbuffer reader (no schema module: tflite_runtime ships none)
on malformed files: an answer or a ValueError at once, never a slow walk or a number read from
past the end of the file."""
import os
import struct
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from pkm_serve import tflite  # noqa: E402
from pkm_serve.tflite_metadata import metadata_names, signature_defs_metadata_size  # noqa: E402
from tests.tflite.metadata_entries import with_metadata_entry  # noqa: E402


def _with_entry(model_bytes, name, blob):
    return bytearray(with_metadata_entry(model_bytes, name, blob))


def _field_position(data, table, index):
    """Where a flatbuffer table's field is (the reference: the schema's own layout rules)."""
    vtable = table - struct.unpack_from("<i", data, table)[0]
    return table + struct.unpack_from("<H", data, vtable + 4 + 2 * index)[0]


def test_a_metadata_vector_over_a_zero_table_is_read_at_once():
    """A metadata vector whose offset points into a table of zeros (a corrupt file) with a count
    that fits the file: each zero "entry" read as a table without fields, one at a time, took
    ~0.5 s a MB (minutes for a 2 GB model); a zero vtable is no vtable, so it stops at the first."""
    model = _with_entry(tflite.build_embedding_bag_model(np.zeros((1 << 14, 64), np.float32), 2), "x", b"abc")
    assert metadata_names(bytes(model)) == ["x"]
    root = struct.unpack_from("<I", model, 0)[0]
    at = _field_position(model, root, 6)   # Model.metadata
    zeros = len(model) // 2 // 4 * 4
    assert model[zeros:zeros + 4096] == bytes(4096)
    struct.pack_into("<I", model, at, zeros - at)
    for count in ((len(model) - zeros - 4) // 4, 0xFFFFFFF0):
        struct.pack_into("<I", model, zeros, count)
        start = time.perf_counter()
        assert metadata_names(bytes(model)) == [] and signature_defs_metadata_size(bytes(model)) is None
        assert time.perf_counter() - start < 0.3


def test_a_signature_defs_blob_running_past_the_files_end_is_refused():
    """The entry's buffer declares more bytes than the file holds (a truncated copy): the slice
    stopped at the end and the count was read from what was there; flatbuffers' own reader
    (the server's) refuses such a buffer, and so does this one now."""
    from flatbuffers import flexbuffers
    blob = bytes(flexbuffers.Dumps({"a": b"x", "b": b"y"}))
    model = _with_entry(tflite.build_embedding_bag_model(np.ones((4, 2), np.float32), 2),
                        "signature_defs_metadata", b"placeholder")
    schema = tflite.flatbuffer_schema()
    m = schema.Model.GetRootAsModel(model, 0)
    (index,) = [m.Metadata(i).Buffer() for i in range(m.MetadataLength())]
    buffer_table = m.Buffers(index)._tab.Pos
    data_field = _field_position(model, buffer_table, 0)
    model += bytes(-len(model) % 4)
    end = len(model)
    model += struct.pack("<I", len(blob)) + blob   # the blob moved to the file's end
    struct.pack_into("<I", model, data_field, end - data_field)
    assert signature_defs_metadata_size(bytes(model)) == 2
    struct.pack_into("<I", model, end, len(blob) + 3)   # 3 bytes more than there are
    with pytest.raises(Exception):
        schema.Model.GetRootAsModel(model, 0).Buffers(index).DataAsNumpy()
    with pytest.raises(ValueError, match=r"Invalid SignatureDefs found .*run past the file's end"):
        signature_defs_metadata_size(bytes(model))
