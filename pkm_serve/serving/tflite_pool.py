"""The interpreters of a version served from its model.tflite (tflite_servable.py): each
runs one request at a time, and a 0-row request's one-row probe runs on the request's own
interpreter or, where the model keeps state, on one of its own."""
import contextlib
import queue
import threading

import grpc

from pkm_serve import tflite
from pkm_serve.serving.errors import ServingError


def assigns_resource_variables(model_bytes) -> bool:
    """Whether the model writes a resource variable (an ASSIGN_VARIABLE op in any subgraph):
    its interpreter then keeps state from one invoke to the next."""
    schema = tflite.flatbuffer_schema()
    model = schema.Model.GetRootAsModel(model_bytes, 0)
    assign = schema.BuiltinOperator.ASSIGN_VARIABLE
    for i in range(model.OperatorCodesLength()):
        code = model.OperatorCodes(i)
        if max(code.BuiltinCode(), code.DeprecatedBuiltinCode()) == assign:
            return True
    return False


class InterpreterPool:
    """make_probe: None, or what makes the interpreter that probes alone run on (made at the
    first probe), for a model that assigns resource variables."""

    def __init__(self, interpreters, make_probe=None):
        self._free = queue.SimpleQueue()   # FIFO: consecutive takes visit every interpreter
        for i in interpreters:
            self._free.put(i)
        self.size = len(interpreters)
        self.closed = False
        self._make_probe, self._probe = make_probe, None
        self._probe_lock = threading.Lock()

    @contextlib.contextmanager
    def take(self):
        while True:   # (an unload that gave up draining must not leave a request waiting)
            if self.closed:
                raise ServingError(grpc.StatusCode.UNAVAILABLE, "this model version was unloaded")
            try:
                interp = self._free.get(timeout=1.0)
                break
            except queue.Empty:
                continue
        try:
            yield interp
        finally:
            self._free.put(interp)

    @contextlib.contextmanager
    def probing(self, interp):
        """The interpreter to run a 0-row request's one-row probe on: interp (the request's),
        or for a model that assigns resource variables one kept for probes, so the probe's row
        is not in the state later requests read (a rows-seen counter counted it: the SavedModel
        of the same model runs the 0 rows alone)."""
        if self._make_probe is None:
            yield interp
            return
        with self._probe_lock:
            if self._probe is None:
                self._probe = self._make_probe()
            yield self._probe

    def close(self):
        self.closed = True
        with self._probe_lock:
            self._probe = None
        while True:   # drop the interpreters (requests that held one have finished: unload)
            try:
                self._free.get_nowait()
            except queue.Empty:
                return
