"""Classify/Regress over an ExampleListWithContext feed the model what TF Serving feeds it:
each example's serialized bytes after the context's (tensorflow/serving,
tensorflow_serving/servables/tensorflow/util.cc, InputToSerializedExampleTensor: StrCat(context,
entry)). A merged copy of each example was fed instead: other bytes (a model reading them
answered other numbers), and ~1.3 KB of memory an example."""
import pytest
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import regression_pb2

from serving_helpers import polled_manager, save_graph


@pytest.fixture(scope="module")
def service(tmp_path_factory, tf_with_ops):
    """Model m, a TF1 graph: regress_x reads feature x, regress_length the byte length of the
    serialized example it is fed."""
    from pkm_serve.serving.service import InferenceService

    tf = tf_with_ops
    base = tmp_path_factory.mktemp("context")
    with tf.Graph().as_default():
        serialized = tf.compat.v1.placeholder(tf.string, [None], name="tf_example")
        x = tf.io.parse_example(serialized, {"x": tf.io.FixedLenFeature([1], tf.float32)})["x"]
        length = tf.cast(tf.strings.length(serialized), tf.float32)
        save_graph(base / "1", {
            "regress_x": tf.compat.v1.saved_model.regression_signature_def(serialized, x),
            "regress_length": tf.compat.v1.saved_model.regression_signature_def(serialized, length)})
    manager = polled_manager(base)
    yield InferenceService(manager)
    manager.stop()


def _example(**floats):
    ex = example_pb2.Example()
    for key, values in floats.items():
        ex.features.feature[key].float_list.value.extend(values)
    return ex


def _regress(service, signature, context, examples):
    req = regression_pb2.RegressionRequest(model_spec={"name": "m", "signature_name": signature})
    req.input.example_list_with_context.context.CopyFrom(context)
    req.input.example_list_with_context.examples.extend(examples)
    return [r.value for r in service.regress(req).result.regressions]


def test_each_example_is_fed_as_the_context_bytes_then_its_own(service):
    context = _example(x=[3.0], z=[1.0, 2.0])
    examples = [_example(), _example(y=[5.0]), _example(x=[7.0])]
    expected = [len(context.SerializeToString() + e.SerializeToString()) for e in examples]
    assert _regress(service, "regress_length", context, examples) == expected
    # Parsed, the example's own feature wins over the context's.
    assert _regress(service, "regress_x", context, examples) == [3.0, 3.0, 7.0]
