"""FunctionGraph.remove_dead on random FunctionDefs, against the rule it
implements restated as a fixed point: a node goes when it is not returned,
every consumer of it (data or control) goes, and it is a seed or a
side-effect-free producer of a node that goes. The rest of the FunctionDef
keeps its order, and the indexes afterwards equal a fresh index."""
import random

import pytest
from tensorflow.core.framework import function_pb2

from pkm_serve.export.graph import FunctionGraph, Ref

# op -> (number of inputs, number of outputs, stateful)
OPS = {"Const": (0, 1, False), "Identity": (1, 1, False), "AddV2": (2, 1, False),
       "IdentityN": (2, 2, False), "RandomUniform": (1, 1, True)}


def _random_function(rng, size):
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = "f"
    arg = fdef.signature.input_arg.add()
    arg.name = "x"
    outputs = [("x", "x")]  # (producer, tensor name) pairs
    for i in range(size):
        op = rng.choice(list(OPS)) if outputs else "Const"
        n_in, n_out, _ = OPS[op]
        node = fdef.node_def.add(name=f"n{i}", op=op)
        for _ in range(n_in):
            node.input.append(rng.choice(outputs)[1])
        if op == "IdentityN":
            node.attr["T"].list.type.extend([1, 1])
        if rng.random() < 0.25 and i > 0:
            node.input.append("^n" + str(rng.randrange(i)))
        out_arg = "z" if op == "AddV2" else "output"
        outputs.extend((node.name, f"{node.name}:{out_arg}:{k}") for k in range(n_out))
    for k, (_, tensor) in enumerate(rng.sample(outputs, 2)):
        fdef.signature.output_arg.add(name=f"y{k}")
        fdef.ret[f"y{k}"] = tensor
    if rng.random() < 0.5:
        fdef.control_ret["side"] = f"n{rng.randrange(size)}"
    return fdef


def _expected_removed(fdef, seeds):
    consumers, producers = {}, {}
    for node in fdef.node_def:
        for text in node.input:
            src = text.lstrip("^").split(":")[0]
            consumers.setdefault(src, set()).add(node.name)
            producers.setdefault(node.name, set()).add(src)
    protected = {t.split(":")[0] for t in fdef.ret.values()} | set(fdef.control_ret.values())
    stateful = {n.name for n in fdef.node_def if OPS[n.op][2]}
    removed, changed = set(), True
    while changed:
        changed = False
        for node in fdef.node_def:
            name = node.name
            if name in removed or name in protected:
                continue
            if not consumers.get(name, set()) <= removed:
                continue
            fed_removed = any(name in producers.get(r, ()) for r in removed)
            if name in seeds or (name not in stateful and fed_removed):
                removed.add(name)
                changed = True
    return removed


@pytest.mark.parametrize("seed", range(40))
def test_remove_dead_matches_the_fixed_point(seed):
    rng = random.Random(seed)
    fdef = _random_function(rng, rng.randrange(5, 60))
    seeds = rng.sample([n.name for n in fdef.node_def], rng.randrange(1, 6))
    want = _expected_removed(fdef, set(seeds))
    order = [n.name for n in fdef.node_def]

    fg = FunctionGraph(fdef, {})
    got = fg.remove_dead(seeds)

    assert len(got) == len(set(got))
    assert set(got) == want
    assert [n.name for n in fdef.node_def] == [n for n in order if n not in want]
    fresh = FunctionGraph(fdef, {})
    assert fg.nodes.keys() == fresh.nodes.keys()
    assert fg.data_consumers == fresh.data_consumers
    assert fg.control_consumers == fresh.control_consumers


def test_a_removed_nodes_inputs_are_parsed_by_output_name():
    """IdentityN's second output is 'output:1' (flat index 1): the node reading
    it is a consumer of Ref(node, 1), not of output 0."""
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = "f"
    fdef.signature.input_arg.add(name="x")
    fdef.signature.output_arg.add(name="y")
    ident = fdef.node_def.add(name="pair", op="IdentityN", input=["x", "x"])
    ident.attr["T"].list.type.extend([1, 1])
    fdef.node_def.add(name="dead", op="Identity", input=["pair:output:1"])
    fdef.node_def.add(name="live", op="Identity", input=["pair:output:0"])
    fdef.ret["y"] = "live:output:0"
    fg = FunctionGraph(fdef, {})
    assert fg.consumers(Ref("pair", 1)) == [("dead", 0)]
    assert fg.remove_dead(["dead"]) == ["dead"]
    assert sorted(fg.nodes) == ["live", "pair"]
    assert fg.consumers(Ref("pair", 1)) == []
