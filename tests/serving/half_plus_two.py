"""half_plus_two-style SavedModels (y = 0.5 * x + 2), written from TF Serving's
description of its test models (tensorflow_serving/servables/tensorflow/testdata/
saved_model_half_plus_two*.py): a TF1 graph flavour and a TF2 `tf.saved_model.save`
flavour, each with predict, classify and regress signatures."""
import os

A, B = 0.5, 2.0


def half_plus_two(x):
    return A * x + B


def write_tf1(path):
    """TF1 graph: serialized tf.Examples -> x (feature "x", one float) -> y.

    serving_default   predict   {"x": x} -> {"y": y}        (x is an Identity, fed by name)
    classify_x_to_y   classify  examples -> scores = y
    regress_x_to_y    regress   examples -> outputs = y"""
    import tensorflow as tf
    v1 = tf.compat.v1
    with tf.Graph().as_default():
        a, b = v1.Variable(A, name="a"), v1.Variable(B, name="b")
        serialized = v1.placeholder(tf.string, name="tf_example")
        parsed = v1.io.parse_example(serialized, {"x": v1.io.FixedLenFeature([1], tf.float32)})
        x = tf.identity(parsed["x"], name="x")
        y = tf.add(tf.multiply(a, x), b, name="y")
        sigs = {
            "serving_default": v1.saved_model.predict_signature_def({"x": x}, {"y": y}),
            "classify_x_to_y": v1.saved_model.classification_signature_def(serialized, None, y),
            "regress_x_to_y": v1.saved_model.regression_signature_def(serialized, y),
        }
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            builder = v1.saved_model.Builder(path)
            builder.add_meta_graph_and_variables(sess, ["serve"], signature_def_map=sigs)
            builder.save()
    return path


def write_tf2(path, scale=A):
    """TF2 `tf.saved_model.save`: every signature's method_name is .../predict.

    serving_default   x [-1, 1] float32 -> {"y": y}
    classify_x_to_y   inputs [-1] string (tf.Example) -> {"scores": y}
    regress_x_to_y    inputs [-1] string (tf.Example) -> {"outputs": y}"""
    import tensorflow as tf

    class HalfPlusTwo(tf.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = tf.Variable(scale), tf.Variable(B)

        def _y(self, x):
            return self.a * x + self.b

        def _from_examples(self, inputs):
            x = tf.io.parse_example(inputs, {"x": tf.io.FixedLenFeature([1], tf.float32)})["x"]
            return self._y(x)

    m = HalfPlusTwo()
    predict = tf.function(lambda x: {"y": m._y(x)},
                          input_signature=[tf.TensorSpec([None, 1], tf.float32, name="x")])
    classify = tf.function(lambda inputs: {"scores": m._from_examples(inputs)},
                           input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    regress = tf.function(lambda inputs: {"outputs": m._from_examples(inputs)},
                          input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    tf.saved_model.save(m, path, signatures={
        "serving_default": predict.get_concrete_function(),
        "classify_x_to_y": classify.get_concrete_function(),
        "regress_x_to_y": regress.get_concrete_function()})
    return path


def write_versioned(base, version, writer, **kwargs):
    """base/<version> written to a temp name and renamed (what a deployment should do)."""
    os.makedirs(base, exist_ok=True)
    tmp = os.path.join(base, f".tmp-{version}")
    writer(tmp, **kwargs)
    os.rename(tmp, os.path.join(base, str(version)))
    return os.path.join(base, str(version))
