"""The interpreters of a version served from its model.tflite (tflite_servable.py): each
runs one request at a time, and a 0-row request's one-row probe runs on the request's own
interpreter or, where the model keeps state, on one of its own."""
import contextlib
import queue
import threading

import grpc

from pkm_serve import tflite
from pkm_serve.serving.errors import ServingError


def _called_subgraphs(schema, op):
    """The subgraphs an op runs (WHILE's, IF's, a StableHLO op's..., STABLEHLO_CASE's list of
    branches), from the fields of its options that name them, but CALL_ONCE's init subgraph: it runs once per interpreter, at
    the first invoke, however many requests follow (the session initialiser, which assigns
    the variables their initial values)."""
    found = []
    for kind, get, enum in ((op.BuiltinOptionsType(), op.BuiltinOptions(), schema.BuiltinOptions),
                            (getattr(op, "BuiltinOptions2Type", lambda: 0)(),
                             getattr(op, "BuiltinOptions2", lambda: None)(),
                             getattr(schema, "BuiltinOptions2", None))):
        if not kind or get is None or enum is None:
            continue
        name = next((n for n, v in vars(enum).items() if v == kind and not n.startswith("_")), None)
        options_class = getattr(schema, name or "", None)
        if options_class is None:
            continue
        options = options_class()
        options.Init(get.Bytes, get.Pos)
        for method in dir(options):
            if (method.endswith("SubgraphIndex") and method != "InitSubgraphIndex") or \
                    (name == "CallOptions" and method == "Subgraph"):
                found.append(int(getattr(options, method)()))
            elif method.endswith("SubgraphIndicesLength"):
                listed = getattr(options, method[:-len("Length")])
                found.extend(int(listed(j)) for j in range(getattr(options, method)()))
    return found


def assigns_resource_variables(model_bytes, subgraphs=None) -> bool:
    """Whether a request can write a resource variable: an ASSIGN_VARIABLE op in the subgraphs
    the requests run (``subgraphs``: their indices; None: every subgraph) or in one they call.
    Its interpreter then keeps state from one invoke to the next. (The session initialiser's
    assignments, run once, and those of a signature not served, keep none.)"""
    schema = tflite.flatbuffer_schema()
    model = schema.Model.GetRootAsModel(model_bytes, 0)
    assign = schema.BuiltinOperator.ASSIGN_VARIABLE
    codes = [max(model.OperatorCodes(i).BuiltinCode(), model.OperatorCodes(i).DeprecatedBuiltinCode())
             for i in range(model.OperatorCodesLength())]
    if assign not in codes:
        return False
    todo = list(range(model.SubgraphsLength()) if subgraphs is None else subgraphs)
    seen = set()
    while todo:
        index = todo.pop()
        if index in seen or not 0 <= index < model.SubgraphsLength():
            continue
        seen.add(index)
        graph = model.Subgraphs(index)
        for i in range(graph.OperatorsLength()):
            op = graph.Operators(i)
            if 0 <= op.OpcodeIndex() < len(codes) and codes[op.OpcodeIndex()] == assign:
                return True
            todo.extend(_called_subgraphs(schema, op))
    return False


def served_subgraphs(model_bytes, runs_own_subgraph) -> list:
    """The subgraphs requests run, for {signature key: whether it runs through its signature
    runner}: such a signature its own subgraph, any other (SignatureDefs from the metadata, a
    model without signatures) the primary one."""
    model = tflite.flatbuffer_schema().Model.GetRootAsModel(model_bytes, 0)
    of_key = {}
    for i in range(model.SignatureDefsLength()):
        key = model.SignatureDefs(i).SignatureKey()
        of_key[key.decode("utf-8", "replace") if key is not None else ""] = model.SignatureDefs(i).SubgraphIndex()
    return sorted({of_key[key] if own else 0 for key, own in runs_own_subgraph.items()})


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
