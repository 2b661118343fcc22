"""assigns_resource_variables follows the subgraphs a served subgraph's ops run (WHILE's, IF's,
a StableHLO op's: one index each, STABLEHLO_CASE's a list of branches), not CALL_ONCE's
initialiser. Models built as flatbuffers: subgraph 0 runs one op naming its subgraphs;
subgraph 2 assigns a resource variable, subgraph 1 does not."""
import flatbuffers
import pytest

from pkm_serve import tflite
from pkm_serve.serving.tflite_pool import assigns_resource_variables


def _model(op_name, options_name, fields, second_union=False):
    schema = tflite.flatbuffer_schema()
    ops = schema.BuiltinOperator
    model = schema.ModelT()
    model.version = 3
    model.operatorCodes = []
    for name in (op_name, "ASSIGN_VARIABLE"):
        code = schema.OperatorCodeT()
        code.builtinCode = getattr(ops, name)
        code.deprecatedBuiltinCode = min(code.builtinCode, ops.PLACEHOLDER_FOR_GREATER_OP_CODES)
        model.operatorCodes.append(code)
    options = getattr(schema, options_name + "T")()
    for field, value in fields.items():
        setattr(options, field, value)
    caller = schema.OperatorT()
    caller.opcodeIndex, caller.inputs, caller.outputs = 0, [], []
    kind = getattr(schema.BuiltinOptions2 if second_union else schema.BuiltinOptions, options_name)
    if second_union:
        caller.builtinOptions2Type, caller.builtinOptions2 = kind, options
    else:
        caller.builtinOptionsType, caller.builtinOptions = kind, options
    assign = schema.OperatorT()
    assign.opcodeIndex, assign.inputs, assign.outputs = 1, [], []
    model.subgraphs = []
    for operators in ([caller], [], [assign]):
        graph = schema.SubGraphT()
        graph.tensors, graph.inputs, graph.outputs, graph.operators = [], [], [], operators
        model.subgraphs.append(graph)
    model.buffers = [schema.BufferT()]
    builder = flatbuffers.Builder(1 << 10)
    builder.Finish(model.Pack(builder), file_identifier=tflite.TFLITE_FILE_IDENTIFIER)
    return bytes(builder.Output())


@pytest.mark.parametrize("op_name, options_name, fields, second_union, assigns", [
    ("WHILE", "WhileOptions", {"condSubgraphIndex": 1, "bodySubgraphIndex": 2}, False, True),
    ("WHILE", "WhileOptions", {"condSubgraphIndex": 1, "bodySubgraphIndex": 1}, False, False),
    ("IF", "IfOptions", {"thenSubgraphIndex": 1, "elseSubgraphIndex": 2}, False, True),
    ("CALL_ONCE", "CallOnceOptions", {"initSubgraphIndex": 2}, False, False),
    ("STABLEHLO_COMPOSITE", "StableHLOCompositeOptions", {"decompositionSubgraphIndex": 2}, True, True),
    ("STABLEHLO_CASE", "StablehloCaseOptions", {"branchSubgraphIndices": [1, 2]}, True, True),
    ("STABLEHLO_CASE", "StablehloCaseOptions", {"branchSubgraphIndices": [1]}, True, False),
])
def test_the_subgraphs_an_op_runs_are_followed(op_name, options_name, fields, second_union, assigns):
    """STABLEHLO_CASE's branches (a vector of indices, not one ...SubgraphIndex) were not
    followed: a served subgraph whose case branch assigns was taken for one that assigns nothing."""
    model = _model(op_name, options_name, fields, second_union)
    assert assigns_resource_variables(model, [0]) == assigns
    assert assigns_resource_variables(model, [2])   # (the assigning subgraph itself, served)
