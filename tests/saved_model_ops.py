"""What a SavedModel's graph holds, read from saved_model.pb (no TF graph built)."""
import os


def graph_op_types(saved_model_dir):
    """Op types of every node of the first MetaGraph, its functions included."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    with open(os.path.join(saved_model_dir, "saved_model.pb"), "rb") as f:
        proto.ParseFromString(f.read())
    graph = proto.meta_graphs[0].graph_def
    types = {node.op for node in graph.node}
    for function in graph.library.function:
        types.update(node.op for node in function.node_def)
    return types
