"""REST front end (aiohttp) with TF Serving's URLs and JSON formats.

  GET  /v1/models/NAME[/versions/N | /labels/L]             model status
  GET  /v1/models/NAME[/versions/N | /labels/L]/metadata    signature defs
  POST /v1/models/NAME[/versions/N | /labels/L]:predict     {"instances": [...]} or {"inputs": ...}
  POST ...:classify / ...:regress                           {"examples": [...], "context": {...}}
  GET  <prometheus path>                                    metrics (when monitoring is enabled)
Errors are {"error": "..."} with the HTTP status TF Serving uses for the gRPC code;
a malformed /v1/ URL is 400 (as TF Serving's handler answers), any other path 404.
"""
import asyncio
import functools
import json
import logging
import re
import threading
import time
import urllib.parse
import zlib
from concurrent import futures

import grpc
import numpy as np
import orjson
from aiohttp import web
from google.protobuf import json_format
from tensorflow_serving.apis import get_model_metadata_pb2, get_model_status_pb2, model_pb2

from pkm_serve.serving import rest_requests, tensors
from pkm_serve.serving.json_body import TOO_DEEP, loads
from pkm_serve.serving.errors import ServingError, http_status, invalid
from pkm_serve.serving.ports import check_bindable
from pkm_serve.serving.rest_cors import cors_middleware

log = logging.getLogger("pkm_serve.serving")

# http_rest_api_util.cc's two patterns, matched case-insensitively (/V1/Models/m:predict is
# served) on the path as sent; the name and label are percent-decoded after the match (so
# %2F in a name is the name's, not a separator). The verb and "metadata" are then compared
# as spelled, as its handler does: POST ...:Predict is malformed, GET .../METADATA a status.
_POST_URL = re.compile(r"/v1/models/(?P<name>[^/:]+)(?:/versions/(?P<version>\d+)|/labels/(?P<label>[^/:]+))?"
                       r":(?P<verb>classify|regress|predict)", re.IGNORECASE)
_GET_URL = re.compile(r"/v1/models(?:/(?P<name>[^/:]+))?(?:/versions/(?P<version>\d+)|/labels/(?P<label>[^/:]+))?"
                      r"(?:/(?P<verb>metadata))?", re.IGNORECASE)
_EXPECTED_URL = "/v1/models/NAME[/versions/N|/labels/L][/metadata|:predict|:classify|:regress]"
_INT64_MAX = (1 << 63) - 1


# An absolute-form request target's scheme and authority ("http://host:8501" before the path).
_ABSOLUTE_FORM_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")


def _path_and_query(request_target: str) -> str:
    """The request target's path and query as sent, as TF Serving's EvHTTPRequest::uri_path
    (evhttp_uri_parse): an absolute-form target ("POST http://host/v1/...", which an HTTP/1.1
    server must accept, RFC 9112 3.2.2) yields the same as its origin form."""
    prefix = _ABSOLUTE_FORM_PREFIX.match(request_target)
    return request_target[prefix.end():] if prefix else request_target


def _parse_url(method, raw_path):
    """(ModelSpec, api) of a /v1/ request, or ServingError as TF Serving's handler answers."""
    pattern = {"POST": _POST_URL, "GET": _GET_URL}.get(method)
    m = pattern.fullmatch(raw_path) if pattern is not None else None
    malformed = invalid(f"Malformed request: {method} {raw_path} (expected {_EXPECTED_URL})")
    if m is None or (method == "POST" and m["verb"] not in ("classify", "regress", "predict")):
        raise malformed
    if not m["name"]:   # GET /v1/models
        raise invalid("Missing model name in request.")
    spec = model_pb2.ModelSpec(name=urllib.parse.unquote(m["name"]))
    if m["version"] is not None:
        if int(m["version"]) > _INT64_MAX:   # absl::SimpleAtoi fails
            raise invalid(f"Failed to convert version: {m['version']} to numeric.")
        spec.version.value = int(m["version"])
    elif m["label"] is not None:
        spec.version_label = urllib.parse.unquote(m["label"])
    if method == "POST":
        return spec, m["verb"]
    return spec, "get_model_metadata" if m["verb"] == "metadata" else "get_model_status"


def _to_dict(message):
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


# JSON goes through orjson (C): with the stdlib json, encoding and decoding took 85% of the
# server's Python time for a batch-64 REST predict (py-spy, bench/serving_load.py). The
# stdlib stays the fallback for what orjson does differently: it writes NaN/Infinity as
# null and refuses them on input, and reads integers beyond 64 bits as floats (which
# would turn an out-of-range error into a silently rounded value).
def dumps(obj) -> bytes:
    try:
        data = orjson.dumps(obj)
    except TypeError:            # e.g. an integer beyond 64 bits
        return json.dumps(obj).encode()
    if b"null" in data:          # none of our bodies holds None: a NaN/Infinity was nulled
        return json.dumps(obj).encode()
    return data


def _may_spell_bools(body: bytes) -> bool:
    """Whether a JSON body may hold true/false (read as UTF-8, as rapidjson reads every body)."""
    return b"true" in body or b"false" in body


def _json_response(obj, status=200):
    return web.Response(body=dumps(obj), status=status, content_type="application/json")


def _error(code: grpc.StatusCode, message: str):
    # (a message naming a string of the body may hold a lone surrogate, which the JSON
    # written would spell as an escape that strict parsers refuse)
    return _json_response({"error": rest_requests.valid_unicode(message)}, status=http_status(code))


_example, _feature = rest_requests.example, rest_requests.feature   # (tests call them by these names)


def _float32_json(values):
    """float32 values (read from a proto's float field) by TF Serving's WriteDecimal<float>."""
    return tensors.write_decimal_float32(np.array(values, np.float32)).tolist() if values else []


def _row_count(outputs) -> int:
    """The rows of a row-format answer: dimension 0 of every output, which must agree
    (json_tensor.cc's MakeRowFormatJsonFromTensors; it need not be the count of instances)."""
    rows = None
    for k, v in sorted(outputs.items()):
        if v.ndim == 0:
            raise invalid(f"Tensor name: {k} has no shape information (a scalar output has no rows: "
                          "use the columnar \"inputs\" format for this signature)")
        if v.shape[0] < 1:
            raise invalid(f"Tensor name: {k} has invalid batch size: {v.shape[0]}")
        if rows is not None and v.shape[0] != rows:
            raise invalid(f"Tensor name: {k} has inconsistent batch size: {v.shape[0]} expecting: {rows}")
        rows = v.shape[0]
    return rows


class _BodyTooLarge(Exception):
    """A request body (gunzipped, where it says gzip) past --max_request_bytes."""


class RestFrontend:
    def __init__(self, service, metrics, monitoring, *, address, port, num_threads, timeout_ms,
                 max_body_bytes, drain_seconds, ssl_config=None, cors=False):
        self.service = service
        self.metrics = metrics
        self.timeout_s = timeout_ms / 1000.0 if timeout_ms > 0 else None   # 0: no deadline (TF Serving)
        self.max_body_bytes = max_body_bytes
        self.executor = futures.ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="rest")
        self.address, self.requested_port = address, port
        check_bindable("REST", address, port)   # before the models load; start() binds after them
        self.drain_seconds = drain_seconds
        self.ssl_config = ssl_config
        self.metrics_path = None
        if monitoring is not None and monitoring.prometheus_config.enable:
            self.metrics_path = monitoring.prometheus_config.path or "/monitoring/prometheus/metrics"
        middlewares = [cors_middleware(skip_path=self.metrics_path)] if cors else []
        self.app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
        self.app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self.port = None
        self._loop = None
        self._runner = None
        self._thread = None

    # ------------------------------------------------------------ lifecycle
    def start(self):
        ready = threading.Event()
        failure = []

        def run():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._start())
            except Exception as e:  # noqa: BLE001 - reported to the caller of start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="rest", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise OSError(f"cannot start REST server on {self.address}:{self.requested_port}: {failure[0]}")

    async def _start(self):
        ssl_ctx = None
        if self.ssl_config is not None:
            from pkm_serve.serving.config import ssl_server_context
            ssl_ctx = ssl_server_context(self.ssl_config)
        # auto_decompress=False: the body is decoded as TF Serving decodes it (_read_body).
        self._runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=self.drain_seconds,
                                     auto_decompress=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.address, self.requested_port, ssl_context=ssl_ctx,
                           reuse_port=False)
        await site.start()
        self.port = self._runner.addresses[0][1]   # the bound port (requested 0 = any)

    def stop(self):
        """Stops accepting, lets in-flight requests finish (up to drain_seconds)."""
        if self._loop is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            fut.result(self.drain_seconds + 5)
        except Exception:  # noqa: BLE001
            log.exception("REST shutdown")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        # Not wait=True: a handler that outlived the drain is stuck in its model and would
        # hold the shutdown forever.
        self.executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ dispatch
    async def _read_body(self, request: web.Request) -> bytes:
        """The body as TF Serving's evhttp request reads it (ReadRequestBytes): gunzipped where
        Content-Encoding names gzip, read as sent under any other encoding (aiohttp decoded
        deflate and br itself, and refused br without the Brotli module in a plain-text 400)."""
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _BodyTooLarge from None
        except web.RequestPayloadError as e:   # e.g. a chunked body cut short
            raise invalid("cannot read the request body: " + " ".join(str(e).split())) from None
        if not body or "gzip" not in request.headers.get("Content-Encoding", ""):   # absl::StrContains, as upstream
            return body   # (an empty body is upstream's empty document, gzip or not)
        gunzip = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            body = gunzip.decompress(body, self.max_body_bytes + 1)   # (bounded: a gzip bomb stops here)
        except zlib.error as e:
            raise invalid(f"cannot read the request body: it is not the gzip its Content-Encoding says ({e})") \
                from None
        if len(body) > self.max_body_bytes:
            raise _BodyTooLarge
        if not gunzip.eof:
            raise invalid("cannot read the request body: the gzip stream of its Content-Encoding ends early")
        if gunzip.unused_data:   # (another gzip member, or junk: upstream's ZLib refuses "extra data")
            raise invalid(f"cannot read the request body: {len(gunzip.unused_data)} bytes follow the end of "
                          "the gzip stream of its Content-Encoding")
        return body

    async def _dispatch(self, request: web.Request):
        path = request.path
        if self.metrics_path and path == self.metrics_path and request.method == "GET":
            body, ctype = self.metrics.exposition()
            return web.Response(body=body, headers={"Content-Type": ctype})
        # The path with its query, as TF Serving's handler matches it (EvHTTPRequest::uri_path
        # is path_and_query): "?x=1" after a verb makes the URL malformed, after a name it is
        # part of the name; it was dropped here, so such URLs were served.
        raw_path = _path_and_query(request.raw_path)   # (an absolute-form target was a 404)
        if not raw_path.lower().startswith("/v1/"):
            # TF Serving hands every /v1/ path to its API handler; other paths have no handler
            # (evhttp's 404 "Not Found"; not "Malformed request", its handler's 400 words).
            return _error(grpc.StatusCode.NOT_FOUND,
                          f"Not Found: {request.method} {raw_path} (only /v1/ paths are served: {_EXPECTED_URL})")
        try:
            spec, api = _parse_url(request.method, raw_path)
        except ServingError as e:
            return _error(e.code, e.message)
        t0 = time.monotonic()
        code = grpc.StatusCode.OK
        try:
            if request.method == "POST":
                try:
                    body = await self._read_body(request)
                except _BodyTooLarge:
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED
                    return _json_response({"error": f"request body is larger than the limit of "
                                                    f"{self.max_body_bytes} bytes (--max_request_bytes)"},
                                          status=413)
                doc = loads(body)
                if not isinstance(doc, dict):   # json_tensor.cc's ParseJson
                    raise invalid(f"JSON Value: {rest_requests.json_value(doc)} Is not object")
            else:
                doc = None
            deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
            handler = getattr(self, "_" + api)
            if api == "predict":   # a body that spells no true/false needs no scan for them
                handler = functools.partial(handler, may_hold_bools=_may_spell_bools(body))
            loop = asyncio.get_running_loop()
            work = loop.run_in_executor(self.executor, handler, spec, doc, deadline)
            try:
                result = await asyncio.wait_for(work, None if deadline is None else self.timeout_s + 1.0)
            except asyncio.TimeoutError:
                raise ServingError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"request took longer than --rest_api_timeout_in_ms "
                                   f"({int(self.timeout_s * 1000)} ms)") from None
            return _json_response(result)
        except ServingError as e:
            code = e.code
            return _error(e.code, e.message)
        except RecursionError:   # a value nested deeper than any tensor can be (max rank 254)
            code = grpc.StatusCode.INVALID_ARGUMENT
            return _error(code, TOO_DEEP)
        except Exception as e:  # noqa: BLE001
            log.exception("REST %s failed", api)
            code = grpc.StatusCode.INTERNAL
            return _error(code, f"internal error: {type(e).__name__}: {e}")
        finally:
            if self.metrics and api in ("predict", "classify", "regress"):
                self.metrics.request(spec.name, api, "REST", code.name, time.monotonic() - t0)

    # ------------------------------------------------------------ handlers (run in executor)
    # TF Serving prints its status and metadata JSON with default-valued fields included
    # ("status": {"error_code": "OK", "error_message": ""}, "signature_name": "", ...).
    def _get_model_status(self, spec, _doc, _deadline):
        resp = self.service.get_model_status(get_model_status_pb2.GetModelStatusRequest(model_spec=spec))
        return _to_dict(resp)

    def _get_model_metadata(self, spec, _doc, _deadline):
        resp = self.service.get_model_metadata(get_model_metadata_pb2.GetModelMetadataRequest(
            model_spec=spec, metadata_field=["signature_def"]))
        sig_map = get_model_metadata_pb2.SignatureDefMap()
        resp.metadata["signature_def"].Unpack(sig_map)
        return {"model_spec": _to_dict(resp.model_spec), "metadata": {"signature_def": _to_dict(sig_map)}}

    def _predict(self, spec, doc, deadline, may_hold_bools=True):
        # FillPredictRequestFromJson's order: the signature name, the model and signature
        # (GetInfoMap), then the body's keys.
        sig_name = rest_requests.signature_name(doc)
        spec.signature_name = sig_name
        # One resolution: the version whose signature decodes the JSON is the one that runs it.
        with self.service.serving(spec) as servable:
            sig = servable.signature(sig_name, rest=True)
            rest_requests.check_predict_body(doc, sig_name, sig.input_specs)
            if "instances" in doc:
                inputs = self._rows_to_inputs(doc["instances"], sig.input_specs, may_hold_bools)
            else:
                inputs = self._columns_to_inputs(doc["inputs"], sig.input_specs, may_hold_bools)
            self.service.check_predict_method(sig)   # (upstream's Predict checks it after the JSON)
            outputs = self.service.predict_on(servable, sig, inputs, deadline)
        return self._predict_json(doc, outputs)

    @staticmethod
    def _predict_json(doc, outputs):
        if "inputs" in doc:
            if len(outputs) == 1:
                return {"outputs": tensors.to_json(*next(iter(outputs.items())))}
            return {"outputs": {k: tensors.to_json(k, v) for k, v in outputs.items()}}
        n = _row_count(outputs)
        if len(outputs) == 1:
            return {"predictions": tensors.to_json(*next(iter(outputs.items())))}
        columns = {k: tensors.to_json(k, v) for k, v in outputs.items()}
        return {"predictions": [{k: columns[k][i] for k in columns} for i in range(n)]}

    _rows_to_inputs = staticmethod(rest_requests.rows_to_inputs)
    _columns_to_inputs = staticmethod(rest_requests.columns_to_inputs)
    _example_input = staticmethod(rest_requests.example_input)

    def _classify(self, spec, doc, deadline):
        from tensorflow_serving.apis import classification_pb2
        spec.signature_name = rest_requests.signature_name(doc)
        req = classification_pb2.ClassificationRequest(model_spec=spec, input=self._example_input(doc))
        resp = self.service.classify(req, deadline)
        # Scores are float32 (ClassificationResult): printed as TF Serving's WriteDecimal<float>
        # prints them (0.3, not 0.30000001192092896), as predict outputs.
        results = [[[c.label, c.score] for c in cl.classes] for cl in resp.result.classifications]
        scores = iter(_float32_json([score for cl in results for _, score in cl]))
        return {"results": [[[label, next(scores)] for label, _ in cl] for cl in results]}

    def _regress(self, spec, doc, deadline):
        from tensorflow_serving.apis import regression_pb2
        spec.signature_name = rest_requests.signature_name(doc)
        req = regression_pb2.RegressionRequest(model_spec=spec, input=self._example_input(doc))
        resp = self.service.regress(req, deadline)
        return {"results": _float32_json([r.value for r in resp.result.regressions])}   # float32 too
