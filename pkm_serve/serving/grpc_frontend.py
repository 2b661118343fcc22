"""gRPC front end: TF Serving's PredictionService and ModelService, health, reflection."""
import logging
import os
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from tensorflow_serving.apis import (model_service_pb2, model_service_pb2_grpc, prediction_service_pb2,
                                     prediction_service_pb2_grpc)

from pkm_serve.serving.errors import ServingError, invalid
from pkm_serve.serving.ports import check_bindable

log = logging.getLogger("pkm_serve.serving")

PREDICTION_SERVICE = prediction_service_pb2.DESCRIPTOR.services_by_name["PredictionService"].full_name
MODEL_SERVICE = model_service_pb2.DESCRIPTOR.services_by_name["ModelService"].full_name


def _deadline(context):
    remaining = context.time_remaining()
    # grpc reports "no deadline" as a huge number.
    return None if remaining is None or remaining > 1e8 else time.monotonic() + remaining


class _Calls:
    """Runs one RPC: maps ServingError to a status, records metrics, never lets a bug
    escape as a bare exception (which grpc would report without a message)."""

    def __init__(self, service, metrics):
        self.service = service
        self.metrics = metrics

    def __call__(self, api, fn, request, context, model_name):
        t0 = time.monotonic()
        code = grpc.StatusCode.OK
        try:
            return fn(request, _deadline(context)) if api in _WITH_DEADLINE else fn(request)
        except ServingError as e:
            code = e.code
            context.abort(e.code, e.message)
        except Exception as e:  # noqa: BLE001
            log.exception("%s failed", api)
            code = grpc.StatusCode.INTERNAL
            context.abort(code, f"internal error in {api}: {type(e).__name__}: {e}")
        finally:
            if self.metrics:
                self.metrics.request(model_name, api, "GRPC", code.name, time.monotonic() - t0)


MAX_RESPONSE_BYTES = 2 ** 31 - 1   # TF Serving's SetMaxMessageSize(tensorflow::kint32max)

_WITH_DEADLINE = {"predict", "classify", "regress", "multi_inference", "reload_config"}


def _with_model_spec(fn):
    """TF Serving's Predict, Classify, Regress and GetModelMetadata (predict_impl.cc,
    classification_service.cc, ...) refuse a request without a model_spec first, in these
    words. Here, not in the service: warmup records are replayed without one, as upstream's."""
    def checked(request, *args):
        if not request.HasField("model_spec"):
            raise invalid("Missing ModelSpec")
        return fn(request, *args)
    return checked


class PredictionServicer(prediction_service_pb2_grpc.PredictionServiceServicer):
    def __init__(self, calls):
        self._calls = calls
        s = calls.service
        self._fns = {"predict": _with_model_spec(s.predict), "classify": _with_model_spec(s.classify),
                     "regress": _with_model_spec(s.regress), "multi_inference": s.multi_inference,
                     "get_model_metadata": _with_model_spec(s.get_model_metadata)}

    def Predict(self, request, context):
        return self._calls("predict", self._fns["predict"], request, context, request.model_spec.name)

    def Classify(self, request, context):
        return self._calls("classify", self._fns["classify"], request, context, request.model_spec.name)

    def Regress(self, request, context):
        return self._calls("regress", self._fns["regress"], request, context, request.model_spec.name)

    def MultiInference(self, request, context):
        name = request.tasks[0].model_spec.name if request.tasks else ""
        return self._calls("multi_inference", self._fns["multi_inference"], request, context, name)

    def GetModelMetadata(self, request, context):
        return self._calls("get_model_metadata", self._fns["get_model_metadata"], request, context,
                           request.model_spec.name)


class ModelServicer(model_service_pb2_grpc.ModelServiceServicer):
    def __init__(self, calls):
        self._calls = calls

    def GetModelStatus(self, request, context):
        return self._calls("get_model_status", self._calls.service.get_model_status, request, context,
                           request.model_spec.name)

    def HandleReloadConfigRequest(self, request, context):
        return self._calls("reload_config", self._calls.service.reload_config, request, context, "")


class GrpcFrontend:
    def __init__(self, service, metrics, *, address, port, max_threads, max_message_bytes,
                 ssl_config=None, socket_path="", channel_arguments=()):
        self.health = health.HealthServicer()
        # --max_request_bytes bounds requests only: TF Serving lets responses be as large as
        # gRPC allows (server.cc: kint32max), so a small request may get a large answer.
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
                   ("grpc.so_reuseport", 0)]
        # --grpc_channel_arguments come last so that they override the defaults above.
        options = [o for o in options if o[0] not in dict(channel_arguments)] + list(channel_arguments)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_threads,
                                                             thread_name_prefix="grpc"),
                                  options=options, maximum_concurrent_rpcs=max_threads * 4)
        calls = _Calls(service, metrics)
        prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionServicer(calls), self.server)
        model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(calls), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (PREDICTION_SERVICE, MODEL_SERVICE,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        self._target = f"{address}:{port}" if ":" not in address else f"[{address}]:{port}"
        self._credentials = None if ssl_config is None else grpc.ssl_server_credentials(
            [(ssl_config.server_key.encode(), ssl_config.server_cert.encode())],
            root_certificates=ssl_config.custom_ca.encode() or None,
            require_client_auth=ssl_config.client_verify)
        self.socket_path = socket_path
        self.port = port
        # Fails early (before the models load) on a taken port.
        check_bindable("gRPC", address, port, reuse_port=bool(dict(options).get("grpc.so_reuseport")))
        if socket_path and not os.path.isdir(os.path.dirname(os.path.abspath(socket_path))):
            raise OSError(f"cannot bind gRPC to the UNIX socket {socket_path}: its directory does not exist")

    def start(self):
        """Binds the ports and serves. Not in __init__: gRPC listens from the moment a port is
        added, and the port must not accept connections (a TCP probe) while models load."""
        if self._credentials is not None:
            self.port = self.server.add_secure_port(self._target, self._credentials)
        else:
            self.port = self.server.add_insecure_port(self._target)
        if self.port == 0:
            raise OSError(f"cannot bind gRPC to {self._target}")
        # A UNIX socket is local: served without TLS, as TF Serving does.
        if self.socket_path and self.server.add_insecure_port(f"unix:{self.socket_path}") == 0:
            raise OSError(f"cannot bind gRPC to the UNIX socket {self.socket_path}")
        self.server.start()

    def set_serving(self, serving: bool):
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", PREDICTION_SERVICE, MODEL_SERVICE):
            self.health.set(name, status)

    def stop(self, grace, timeout=None):
        """Refuses new RPCs and waits up to `grace` seconds for in-flight ones, then cancels
        them; returns False if the server had not stopped `timeout` seconds after the call
        (grpc waits for every cancelled handler to return, and one stuck in a model never does)."""
        self.set_serving(False)
        stopped = self.server.stop(grace).wait(timeout)
        if not stopped:
            log.warning("gRPC server not stopped %.0fs after the stop began", timeout)
        return stopped
