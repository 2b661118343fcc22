"""One error type for every front end: a gRPC status code plus a message.

gRPC returns it as the RPC status; REST maps the code to an HTTP status the
way TF Serving's HTTP handler does (ToHTTPStatusCode).
"""
import re

import grpc


class ServingError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self):
        return f"{self.code.name}: {self.message}"


def invalid(message):
    return ServingError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message):
    return ServingError(grpc.StatusCode.NOT_FOUND, message)


_HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
}


def http_status(code: grpc.StatusCode) -> int:
    return _HTTP_STATUS.get(code, 500)


# tf.errors.OpError.error_code uses the same numbering as grpc.StatusCode.
_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def from_tf_error(err) -> ServingError:
    code = _BY_NUMBER.get(getattr(err, "error_code", 2), grpc.StatusCode.UNKNOWN)
    return ServingError(code, clean_tf_message(getattr(err, "message", None) or str(err)))


_NOISE = re.compile(r"\s*\[\[\{\{.*?\}\}\]\]|\s*\[Op:[^\]]*\]|Graph execution error:|"
                    r"Detected at node [^\n]*|<stack traces unavailable>")


def clean_tf_message(message: str) -> str:
    """Keeps what the op said (e.g. "indices[1] = 99999 is out of range [0, 4096)") and drops
    graph-node and stack-trace decoration that means nothing to a client."""
    cleaned = " ".join(_NOISE.sub(" ", message).split())
    return cleaned or message.strip()
