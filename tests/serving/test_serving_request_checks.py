"""Request checks of GetModelMetadata (get_model_metadata_impl.cc) and
HandleReloadConfigRequest (model_service_impl.cc), in TF Serving's words."""
import grpc
import pytest
from tensorflow_serving.apis import (get_model_metadata_pb2, model_management_pb2, model_pb2,
                                     model_service_pb2_grpc)
from tensorflow_serving.config import model_server_config_pb2

import half_plus_two as hpt
from serving_helpers import free_port, polled_manager
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.service import InferenceService


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    base = tmp_path_factory.mktemp("checks") / "m"
    hpt.write_versioned(str(base), 1, hpt.write_tf1)
    return base


@pytest.fixture(scope="module")
def service(base):
    manager = polled_manager(base)
    yield InferenceService(manager)
    manager.stop()


@pytest.fixture(scope="module")
def model_stub(service):
    from unittest import mock
    from pkm_serve.serving.grpc_frontend import GrpcFrontend
    frontend = GrpcFrontend(service, mock.MagicMock(), address="127.0.0.1", port=free_port(), max_threads=2,
                            max_message_bytes=1 << 20)
    frontend.start()
    with grpc.insecure_channel(f"127.0.0.1:{frontend.port}") as channel:
        yield model_service_pb2_grpc.ModelServiceStub(channel)
    frontend.stop(0)


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


def _reload(stub, config):
    return stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(config=config), timeout=60)


def test_a_failed_reload_is_the_rpc_status(model_stub, base):
    """model_service_impl.cc returns ReloadConfig's status as the RPC's: a client that catches
    grpc.RpcError heard OK (the error sat in the answer's status field)."""
    bad = model_server_config_pb2.ModelServerConfig()
    bad.model_config_list.config.add(name="m", base_path=str(base), model_platform="pytorch")
    with pytest.raises(grpc.RpcError) as err:
        _reload(model_stub, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pytorch" in err.value.details()
    good = model_server_config_pb2.ModelServerConfig()
    good.model_config_list.config.add(name="m", base_path=str(base), model_platform="tensorflow")
    assert _reload(model_stub, good).status.error_code == 0


def test_a_reload_without_a_model_config_list_is_refused(model_stub):
    with pytest.raises(grpc.RpcError) as err:
        _reload(model_stub, model_server_config_pb2.ModelServerConfig())
    assert (err.value.code(), err.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "ServerModelConfig type not supported by HandleReloadConfigRequest. Only ModelConfigList is currently supported")


def test_status_of_a_version_never_seen_is_upstreams_not_found(service):
    """get_model_status_impl.cc's words (the answer was "model 'm' has no version 7")."""
    from tensorflow_serving.apis import get_model_status_pb2
    request = get_model_status_pb2.GetModelStatusRequest(model_spec=model_pb2.ModelSpec(name="m"))
    request.model_spec.version.value = 7
    with pytest.raises(ServingError) as err:
        service.get_model_status(request)
    assert (err.value.code, err.value.message) == (grpc.StatusCode.NOT_FOUND, "Could not find version 7 of model m")
