"""`--tflite` with `--quantize-table int8`: the .tflite's int8 tables are held to
--quantize-tolerance by the same measure as the int8 SavedModel's (max |error|
over max |original output|, against the original model), and its worst error is
in the report. The .tflite was checked with a fixed rtol/atol of 2e-2 against
the float export, so one 1.9% off (symmetric rows, as the .tflite's were then)
was accepted under --quantize-tolerance 1e-2."""
import os

import numpy as np
import pytest
import tensorflow as tf

from pkm_serve import ops
from pkm_serve import tflite as pkm_tflite
from pkm_serve import tflite_model as pkm_tflite_model
from pkm_serve.export import ExportError, export_saved_model, format_report

ops.load_library()

N, D, K = 2000, 32, 5

pytestmark = pytest.mark.skipif(not os.path.exists(pkm_tflite.delegate_path()),
                                reason="the pkm delegate is not built")


def _offset_rows_with_cancelling_weights(tmp_path):
    """Rows 2 +- 0.5 and bags w = [1, -1, 0, 0, 0]: symmetric per-row int8 (steps of
    max|row| / 127) is ~2% off the output's scale, affine int8 (steps of
    (max - min) / 255, the SavedModel's and the .tflite's) well within 1%."""
    rng = np.random.default_rng(0)
    table = (2.0 + rng.uniform(-0.5, 0.5, (N, D))).astype(np.float32)
    module = tf.Module()
    module.t = tf.Variable(table)

    @tf.function(input_signature=[tf.TensorSpec([None, K], tf.int32, name="i"),
                                  tf.TensorSpec([None, K], tf.float32, name="w")])
    def f(i, w):
        return {"o": tf.reduce_sum(tf.gather(module.t, i) * w[..., None], 1)}
    module.f = f
    tf.saved_model.save(module, str(tmp_path / "src"), signatures={"serving_default": f})
    ids = rng.integers(0, N, (256, K)).astype(np.int32)
    w = np.tile(np.array([1, -1, 0, 0, 0], np.float32), (256, 1))
    np.savez(tmp_path / "in.npz", i=ids, w=w)
    return table, ids, w


def _export(tmp_path, name, tolerance):
    return export_saved_model(str(tmp_path / "src"), str(tmp_path / name), quantize_table="int8",
                              quantize_tolerance=tolerance, tflite=str(tmp_path / f"{name}.tflite"),
                              sample_inputs=str(tmp_path / "in.npz"), quiet=True)


def _symmetric_rows(table):
    """The .tflite's quantiser as it was before zero points (symmetric, z = 0): a
    .tflite coarser than the SavedModel, for the check to catch."""
    q, scales = pkm_tflite_model.quantize_rows_int8(table)
    return q, scales, np.zeros(len(scales), np.int64)


def test_the_tflite_is_held_to_quantize_tolerance_and_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(pkm_tflite_model, "quantize_rows_int8_affine", _symmetric_rows)
    table, ids, w = _offset_rows_with_cancelling_weights(tmp_path)
    reference = (table.astype(np.float64)[ids] * w[..., None]).sum(1)

    with pytest.raises(ExportError, match=r"TFLite verification failed: signature 'serving_default' output "
                       r"'o' of the int8 \.tflite differs from the float model by .* of its scale .*, over "
                       r"--quantize-tolerance 0\.01"):
        _export(tmp_path, "strict", 1e-2)
    assert not os.path.exists(tmp_path / "strict" / "1") and not os.path.exists(tmp_path / "strict.tflite")

    result = _export(tmp_path, "loose", 5e-2)
    got = pkm_tflite.make_interpreter(str(tmp_path / "loose.tflite")).get_signature_runner(
        "serving_default")(i=ids, w=w)["o"]
    actual = float(np.abs(got - reference).max() / np.abs(reference).max())
    assert 1e-2 < actual < 5e-2
    tfl = result.tflite
    assert tfl["tolerance"] == 5e-2
    assert tfl["worst_relative_err"] == pytest.approx(actual, rel=1e-3, abs=1e-5)
    assert [(r["rtol"], r["atol"]) for r in tfl["verification"]] == [
        (0.0, pytest.approx(5e-2 * np.abs(reference).max(), rel=1e-5))]
    assert result.quantization["worst_relative_err"] < 1e-2  # the SavedModel's (affine) int8
    assert result.to_json()["tflite"]["worst_relative_err"] == tfl["worst_relative_err"]
    assert tfl["status"] == "verified with the pkm delegate"
    assert f"tables int8 (worst output error {tfl['worst_relative_err']:.3g} of the output scale, " \
           f"tolerance 0.05); verified with the pkm delegate" in format_report(result)


def test_the_affine_tflite_passes_where_symmetric_rows_did_not(tmp_path):
    """The same rows with the .tflite's own (affine) quantiser: within 1%, as the SavedModel's."""
    table, ids, w = _offset_rows_with_cancelling_weights(tmp_path)
    reference = (table.astype(np.float64)[ids] * w[..., None]).sum(1)
    result = _export(tmp_path, "affine", 1e-2)
    got = pkm_tflite.make_interpreter(str(tmp_path / "affine.tflite")).get_signature_runner(
        "serving_default")(i=ids, w=w)["o"]
    actual = float(np.abs(got - reference).max() / np.abs(reference).max())
    assert actual < 1e-2
    assert result.tflite["worst_relative_err"] == pytest.approx(actual, rel=1e-3, abs=1e-5)


def test_a_non_positive_tolerance_is_refused_before_converting(tmp_path):
    _offset_rows_with_cancelling_weights(tmp_path)
    with pytest.raises(ExportError, match=r"--quantize-tolerance must be > 0, got 0"):
        _export(tmp_path, "zero", 0.0)
    assert not os.path.exists(tmp_path / "zero.tflite")


def test_equal_infinities_are_no_error_and_a_lost_one_is_named():
    """A masked max filled with -inf (now fused) answers -inf for a bag with no kept id. The int8 measure
    took -inf - -inf = NaN and a scale of inf, so an int8 model reproducing -inf exactly was refused, and one
    answering the float32 lowest there (as the converted .tflite does, the stock converter's of the original too) was refused "by inf = nan
    of its scale inf". Equal infinities are now equal (the scale is the finite elements'), and a .tflite
    differing where the float model is inf/NaN is refused saying so."""
    from pkm_serve.export.quantize import relative_error
    from pkm_serve.export.tflite_export import _int8_rows
    from pkm_serve.export.verify import VerificationError

    want = np.array([[-np.inf, 2.0], [np.inf, -1.0]], np.float32)
    err, scale, relative = relative_error(want, want + np.array([[0, 0.02], [0, 0]], np.float32))
    assert (scale, relative) == (2.0, pytest.approx(0.01)) and err == pytest.approx(0.02)
    lowest = np.where(np.isneginf(want), np.finfo(np.float32).min, want)
    with pytest.raises(VerificationError, match=r"1 of 4 elements where the float model gives inf/NaN"):
        _int8_rows("serving_default", {"out": want}, {"out": lowest}, tolerance=0.05)
