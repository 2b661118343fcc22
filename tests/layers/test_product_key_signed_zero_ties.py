"""TF's product-key search on scores tied at 0.0 / -0.0: XLA's TopK ranks in IEEE total order (0.0
above -0.0), where TF's kernel and TFLite tie them, so a jit_compile'd model (Keras' fit under XLA)
picked other slots than the served one (TF kernel, TFLite): slots 0, 2 where the lowest tied are
0, 1. Now every runtime picks the lowest tied slots, as the float64 reference does, and the
weights' gradient is unchanged (checked against finite differences)."""
import numpy as np
import tensorflow as tf

from pkm_serve.product_keys import product_key_search
from tests.backends.round35_checks import _lowest_slots, _signed_zero_inputs


def test_signed_zero_ties_pick_the_lowest_slots_eager_under_xla_and_in_tflite():
    query, keys, knn = _signed_zero_inputs()
    want = _lowest_slots(query, keys, knn)

    @tf.function(input_signature=[tf.TensorSpec([None, 1, 2, 1], tf.float32, name="query")])
    def search(q):
        return {"slots": product_key_search(q, tf.constant(keys), knn)[0]}
    converter = tf.lite.TFLiteConverter.from_concrete_functions([search.get_concrete_function()], search)
    interpreter = tf.lite.Interpreter(model_content=converter.convert())
    interpreter.resize_tensor_input(interpreter.get_input_details()[0]["index"], list(query.shape))
    interpreter.allocate_tensors()
    interpreter.set_tensor(interpreter.get_input_details()[0]["index"], query)
    interpreter.invoke()
    got = {"eager": search(tf.constant(query))["slots"],
           "xla": tf.function(search.python_function, jit_compile=True)(tf.constant(query))["slots"],
           "tflite": interpreter.get_tensor(interpreter.get_output_details()[0]["index"])}
    for how, slots in got.items():
        assert np.sort(np.asarray(slots), axis=-1).tolist() == want, f"{how}: {np.asarray(slots).tolist()}"


def test_weights_gradient_matches_finite_differences():
    rng = np.random.default_rng(35)
    query = rng.normal(size=(2, 2, 2, 3))
    keys = tf.constant(rng.normal(size=(2, 2, 7, 3)))
    mix = tf.constant(rng.normal(size=(2, 2 * 3)), tf.float32)   # (the weights are float32)

    def read(q):
        return tf.reduce_sum(product_key_search(q, keys, 3)[1] * mix)
    theoretical, numerical = tf.test.compute_gradient(read, [tf.constant(query)], delta=1e-3)
    assert np.abs(theoretical[0]).max() > 0.1   # (the read depends on the query)
    np.testing.assert_allclose(theoretical[0], numerical[0], rtol=1e-3, atol=1e-3)
