"""GetModelMetadata's request checks, as get_model_metadata_impl.cc words them."""
import grpc
import pytest
from tensorflow_serving.apis import get_model_metadata_pb2, model_pb2

import half_plus_two as hpt
from serving_helpers import polled_manager
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.service import InferenceService


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    base = tmp_path_factory.mktemp("metadata") / "m"
    hpt.write_versioned(str(base), 1, hpt.write_tf1)
    manager = polled_manager(base)
    yield InferenceService(manager)
    manager.stop()


def _metadata(service, fields):
    return service.get_model_metadata(get_model_metadata_pb2.GetModelMetadataRequest(
        model_spec=model_pb2.ModelSpec(name="m"), metadata_field=fields))


def test_signature_def_listed_twice_is_served(service):
    """Upstream checks each field is signature_def; a list naming it twice was refused here."""
    resp = _metadata(service, ["signature_def", "signature_def"])
    sigs = get_model_metadata_pb2.SignatureDefMap()
    resp.metadata["signature_def"].Unpack(sigs)
    assert sorted(sigs.signature_def) == ["classify_x_to_y", "regress_x_to_y", "serving_default"]
    assert (resp.model_spec.name, resp.model_spec.version.value) == ("m", 1)


@pytest.mark.parametrize("fields, message", [
    ([], "GetModelMetadataRequest must specify at least one metadata_field"),
    (["signature_def", "foo"], "Metadata field foo is not supported"),
])
def test_bad_metadata_fields_get_tf_serving_words(service, fields, message):
    with pytest.raises(ServingError) as err:
        _metadata(service, fields)
    assert (err.value.code, err.value.message) == (grpc.StatusCode.INVALID_ARGUMENT, message)
