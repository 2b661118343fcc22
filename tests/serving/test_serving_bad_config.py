"""Config-file values that `pkm-serve serve` does not implement or would misuse are
refused with a message naming them, not silently ignored."""
import grpc
import pytest
from google.protobuf import text_format
from tensorflow_serving.config import model_server_config_pb2

from pkm_serve.serving import protos
from pkm_serve.serving.batching import BatchOptions
from pkm_serve.serving.errors import ServingError
from pkm_serve.serving.manager import ModelManager


def _batching(text):
    return text_format.Parse(text, protos.BatchingParameters())


@pytest.mark.parametrize("text, needle", [
    # A negative timeout ran every batch at once (TF Serving refuses it).
    ("max_batch_size { value: 8 } batch_timeout_micros { value: -1 }", "batch_timeout_micros must be >= 0"),
    ("max_batch_size { value: 8 } allowed_batch_sizes: 0 allowed_batch_sizes: 8",
     "allowed_batch_sizes must be positive"),
])
def test_bad_batching_values_are_refused(text, needle):
    with pytest.raises(ValueError, match=needle):
        BatchOptions(_batching(text))


@pytest.mark.parametrize("fields, needle", [
    # Request logging was silently not done.
    ("logging_config { sampling_config { sampling_rate: 1.0 } }", "logging_config (request logging) is not supported"),
    ("model_type: OTHER", "model_type OTHER is not supported"),
])
def test_model_config_fields_the_server_does_not_implement_are_refused(fields, needle):
    cfg = text_format.Parse(
        f'model_config_list {{ config {{ name: "m" base_path: "/m" {fields} }} }}',
        model_server_config_pb2.ModelServerConfig())
    with pytest.raises(ServingError) as e:
        ModelManager.validate_config(cfg)
    assert needle in e.value.message


@pytest.mark.parametrize("fields, needle", [
    ("", "Illegal setting neither ModelServerConfig::model_type (deprecated) nor ModelServerConfig::model_platform."),
    ('model_type: TENSORFLOW model_platform: "tensorflow"',
     "Illegal setting both ModelServerConfig::model_type (deprecated) and ModelServerConfig::model_platform."),
])
def test_a_model_config_names_its_platform_exactly_once(fields, needle):
    """tensorflow/serving's tensorflow_serving/model_servers/server_core.cc (GetPlatform, called for
    every model of a config, at start-up and on a reload): INVALID_ARGUMENT when a model sets neither
    model_platform nor model_type, or both. Such a config was served here, and then stopped
    tensorflow_model_server (tensorflow/serving#1687). A reload of one is refused alike."""
    from tensorflow_serving.apis import model_management_pb2

    from pkm_serve.serving.service import InferenceService

    bad = text_format.Parse(f'model_config_list {{ config {{ name: "m" base_path: "/m" {fields} }} }}',
                            model_server_config_pb2.ModelServerConfig())
    with pytest.raises(ServingError) as e:
        ModelManager.validate_config(bad)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.message
    served = text_format.Parse('model_config_list { config { name: "m" base_path: "/m" model_platform: "tensorflow" } }',
                               model_server_config_pb2.ModelServerConfig())
    manager = ModelManager(served, poll_seconds=-1)
    with pytest.raises(ServingError) as e:
        InferenceService(manager).reload_config(model_management_pb2.ReloadConfigRequest(config=bad))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.message
    manager.stop()


def test_model_type_tensorflow_is_accepted():
    cfg = text_format.Parse('model_config_list { config { name: "m" base_path: "/m" model_type: TENSORFLOW } }',
                            model_server_config_pb2.ModelServerConfig())
    ModelManager.validate_config(cfg)


def test_ssl_config_whose_pem_does_not_load_is_named(tmp_path):
    # gRPC refused the credentials as "cannot bind: Failed to bind to address 127.0.0.1:PORT".
    from pkm_serve.serving import config
    path = tmp_path / "ssl.config"
    path.write_text('server_key: "not a key"\nserver_cert: "not a certificate"\n')
    args = config.parse_args(["--model_base_path=/m", f"--ssl_config_file={path}"])
    with pytest.raises(ValueError, match="server_key, server_cert or custom_ca is not valid PEM") as e:
        config.ssl_config(args)
    assert str(path) in str(e.value)


def test_prometheus_path_without_a_leading_slash_is_refused(tmp_path):
    # No request path equals "metrics": every scrape was a 404, nothing said why.
    from pkm_serve.serving import config
    path = tmp_path / "monitoring.config"
    path.write_text('prometheus_config { enable: true path: "metrics" }')
    args = config.parse_args(["--model_base_path=/m", "--rest_api_port=8501",
                              f"--monitoring_config_file={path}"])
    with pytest.raises(ValueError, match="path 'metrics' must start with '/'"):
        config.monitoring_config(args)
    path.write_text('prometheus_config { enable: true path: "/metrics" }')
    assert config.monitoring_config(args).prometheus_config.path == "/metrics"


def test_a_batching_field_the_server_does_not_declare_is_refused_naming_it(tmp_path):
    """Never silently ignored: a field pkm-serve does not know could change how requests batch."""
    from pkm_serve.serving import config
    path = tmp_path / "batching.config"
    path.write_text("max_batch_size { value: 8 }\nsome_newer_field { value: 1 }\n")
    args = config.parse_args(["--model_base_path=/m", "--enable_batching", f"--batching_parameters_file={path}"])
    with pytest.raises(ValueError) as e:
        config.batching_parameters(args)
    assert 'has no field named "some_newer_field"' in str(e.value) and str(path) in str(e.value)
