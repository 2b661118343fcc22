"""`pkm-serve tflite MODEL` prepares the model before printing its plan: a node with no kernel
(a custom op neither the runtime nor the pkm delegate has, e.g. the converter's ParseExampleV2)
was listed as "runs" with exit 0, and the model then failed to load wherever it was served."""
import numpy as np

from pkm_serve import tflite

TABLE = np.random.default_rng(34).standard_normal((10, 4)).astype(np.float32)


def _with_custom_op_named(name):
    """The one-op bag model with its custom op renamed (no kernel anywhere for it)."""
    import flatbuffers
    schema = tflite.flatbuffer_schema()
    m = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(bytearray(tflite.build_embedding_bag_model(TABLE, 3)), 0))
    m.operatorCodes[0].customCode = name
    b = flatbuffers.Builder(1 << 12)
    b.Finish(m.Pack(b), file_identifier=b"TFL3")
    return bytes(b.Output())


def test_a_node_without_a_kernel_is_an_error_not_a_plan(tmp_path, capsys):
    path = tmp_path / "parse.tflite"
    path.write_bytes(_with_custom_op_named("ParseExampleV2"))
    assert tflite.console_main([str(path)]) == 1
    out, err = capsys.readouterr()
    assert "runs" not in out and "claimed" not in out, out
    assert err.strip().splitlines() == ["pkm-serve tflite: error: Encountered unresolved custom op: ParseExampleV2."]


def test_the_bag_op_is_still_claimed_by_the_delegate(tmp_path, capsys):
    path = tmp_path / "bag.tflite"
    path.write_bytes(tflite.build_embedding_bag_model(TABLE, 3))
    assert tflite.console_main([str(path)]) == 0
    plan = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert plan[0][:2] == ["0", "PkmEmbeddingBag"] and plan[0][-4:] == ["claimed", "by", "node", "1"], plan
    assert plan[1][1] == "DELEGATE" and plan[1][-1] == "runs", plan
    # The model runs as the plan says: numpy float64 reference.
    ids, w = np.array([[0, 9, 2]], np.int32), np.array([[1.0, 0.5, -2.0]], np.float32)
    got = tflite.run_tflite(str(path), [ids, w])[0]
    np.testing.assert_allclose(got, (w[..., None] * TABLE.astype(np.float64)[ids]).sum(axis=1), rtol=1e-5, atol=1e-6)
