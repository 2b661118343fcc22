"""FunctionGraph's edits on random FunctionDefs. remove_dead against the rule
it implements restated as a fixed point: a node goes when it is not returned,
every consumer of it (data or control) goes, and it is a seed or a
side-effect-free producer of a node that goes; the rest of the FunctionDef
keeps its order. After any sequence of edits the consumer indexes, which the
edits keep current themselves, equal a fresh index of the edited FunctionDef,
and each edit did what it says to the FunctionDef's text."""
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
            if rng.random() < 0.2:  # TF does not write these; an edit must still cope
                node.input.append(node.input[-1])
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
    _assert_index_is_current(fg)


def _assert_index_is_current(fg):
    fresh = FunctionGraph(fg.fdef, {})
    assert fg.nodes.keys() == fresh.nodes.keys()
    assert fg.nodes == {n.name: n for n in fg.fdef.node_def}
    canon = lambda index: {k: sorted(v) for k, v in index.items() if v}
    assert canon(fg.data_consumers) == canon(fresh.data_consumers)
    assert canon(fg.control_consumers) == canon(fresh.control_consumers)
    assert fg.returned == fresh.returned
    assert all(fg.inputs(n) == fresh.inputs(n) for n in fg.fdef.node_def)
    assert fg.control_returned == fresh.control_returned


def _outputs(fg):
    return [Ref(n.name, i) for n in fg.fdef.node_def
            for i in range(sum(c for _, c in fg._counts(n.name)))]


def _random_edit(rng, fg):
    """One edit; returns a check of what it did to the FunctionDef."""
    names = [n.name for n in fg.fdef.node_def]
    kind = rng.choice(["add", "redirect", "redirect_control", "replace"])
    if kind == "add":
        inputs = rng.sample(_outputs(fg), 2)
        control = rng.sample(names, 1) if rng.random() < 0.5 else []
        ref = fg.add_op("added", "AddV2", inputs, {}, control=control)
        node = fg.nodes[ref.node]
        want = [fg.render(r) for r in inputs] + ["^" + c for c in control]
        return lambda: list(node.input) == want
    if kind == "redirect":
        # Only to an earlier node's output, so the graph stays acyclic.
        outputs = _outputs(fg)
        j = rng.randrange(1, len(outputs))
        old, new = outputs[j], outputs[rng.randrange(j)]
        if new.node == old.node:
            return lambda: True
        old_text = fg.render(old)
        readers = [(c, p) for c, p in fg.consumers(old)]
        fg.redirect(old, new)
        new_text = fg.render(new)
        return lambda: old_text not in [t for n in fg.fdef.node_def for t in n.input] and \
            old_text not in fg.fdef.ret.values() and \
            all(fg.nodes[c].input[p] == new_text for c, p in readers)
    if kind == "redirect_control":
        i = rng.randrange(1, len(names))
        old, new = names[i], names[rng.randrange(i)]
        fg.redirect_control(old, new)
        return lambda: all("^" + old not in n.input for n in fg.fdef.node_def
                           if n.name != new) and old not in fg.fdef.control_ret.values()
    name = rng.choice(names)
    earlier = names[:names.index(name)]  # an input from an earlier node keeps it acyclic
    inputs = [r for r in _outputs(fg) if r.node in earlier][-1:] or [Ref("x")]
    fg.replace_node(name, "Identity", inputs, {})
    text = fg.render(Ref(name, 0))
    return lambda: fg.nodes[name].op == "Identity" and all(
        t == text for n in fg.fdef.node_def for t in n.input if t.split(":")[0] == name)


@pytest.mark.parametrize("seed", range(40))
def test_edits_keep_the_consumer_indexes_current(seed):
    rng = random.Random(1000 + seed)
    fdef = _random_function(rng, rng.randrange(5, 40))
    fg = FunctionGraph(fdef, {})
    for _ in range(12):
        did = _random_edit(rng, fg)
        assert did()
        _assert_index_is_current(fg)
    seeds = rng.sample([n.name for n in fdef.node_def], 3)
    want = _expected_removed(fdef, set(seeds))
    assert set(fg.remove_dead(seeds)) == want
    _assert_index_is_current(fg)


def test_a_removed_nodes_inputs_are_parsed_by_output_name():
    """IdentityN's second output is 'output:1' (flat index 1): the node reading
    it is a consumer of Ref(node, 1), not of output 0."""
    fdef = _function([("pair", "IdentityN", ["x", "x"]), ("dead", "Identity", ["pair:output:1"]),
                      ("live", "Identity", ["pair:output:0"])], ret={"y": "live:output:0"})
    fdef.node_def[0].attr["T"].list.type.extend([1, 1])
    fg = FunctionGraph(fdef, {})
    assert fg.consumers(Ref("pair", 1)) == [("dead", 0)]
    assert fg.remove_dead(["dead"]) == ["dead"]
    assert sorted(fg.nodes) == ["live", "pair"]
    assert fg.consumers(Ref("pair", 1)) == []


def _function(nodes, ret=None, control_ret=None):
    """A FunctionDef with arg x from (name, op, inputs) triples."""
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = "f"
    fdef.signature.input_arg.add(name="x")
    for name, op, inputs in nodes:
        fdef.node_def.add(name=name, op=op, input=inputs)
    for key, value in (ret or {}).items():
        fdef.signature.output_arg.add(name=key)
        fdef.ret[key] = value
    for key, value in (control_ret or {}).items():
        fdef.control_ret[key] = value
    return fdef


def test_replace_node_moves_readers_of_a_later_output_whose_text_stays_the_same():
    """StringSplit's 'values:0' is output 1; TopKV2's 'values:0' is output 0.
    The reader's input text is the same before and after, its meaning is not."""
    fdef = _function([("split", "StringSplit", ["x", "x"]),
                      ("reader", "Identity", ["split:values:0"])],
                     ret={"y": "reader:output:0"})
    fg = FunctionGraph(fdef, {})
    assert fg.inputs(fg.nodes["reader"]) == [Ref("split", 1)]
    fg.replace_node("split", "TopKV2", [Ref("x"), Ref("x")], {}, control=[])
    assert list(fg.nodes["reader"].input) == ["split:values:0"]
    assert fg.inputs(fg.nodes["reader"]) == [Ref("split", 0)]
    _assert_index_is_current(fg)


def test_replace_node_of_a_returned_node_with_control_inputs():
    fdef = _function([("a", "Const", []), ("b", "AddV2", ["x", "x"]),
                      ("c", "Identity", ["b:z:0", "^a"])],
                     ret={"y": "b:z:0", "w": "c:output:0"})
    fg = FunctionGraph(fdef, {})
    fg.replace_node("b", "Identity", [Ref("x")], {}, control=["a"])
    assert list(fg.nodes["b"].input) == ["x", "^a"]
    assert fdef.ret["y"] == "b:output:0"
    assert list(fg.nodes["c"].input) == ["b:output:0", "^a"]
    assert sorted(fg.control_consumers["a"]) == ["b", "c"]
    _assert_index_is_current(fg)


def test_redirect_control_merges_a_duplicate_and_moves_control_ret():
    fdef = _function([("old", "Const", []), ("new", "Const", []),
                      ("reader", "Identity", ["x", "^old", "^new"])],
                     ret={"y": "reader:output:0"}, control_ret={"side": "old"})
    fg = FunctionGraph(fdef, {})
    fg.redirect_control("old", "new")
    assert list(fg.nodes["reader"].input) == ["x", "^new"]
    assert fdef.control_ret["side"] == "new"
    assert fg.control_returned == {"new"}
    assert fg.control_consumers.get("old") == [] and fg.control_consumers["new"] == ["reader"]
    _assert_index_is_current(fg)


def test_a_name_freed_by_remove_dead_is_reused_with_its_new_outputs():
    """After a removal the freed name may come back as another op: its output
    names are the new op's (AddV2 'z' before, Identity 'output' now)."""
    fdef = _function([("gone", "AddV2", ["x", "x"]), ("keep", "Identity", ["x"])],
                     ret={"y": "keep:output:0"})
    fg = FunctionGraph(fdef, {})
    assert fg.render(Ref("gone", 0)) == "gone:z:0"
    assert fg.remove_dead(["gone"]) == ["gone"]
    added = fg.add_op("gone", "Identity", [Ref("x")], {})
    assert added == Ref("gone", 0)
    reader = fg.add_op("reader", "Identity", [added], {})
    assert list(fg.nodes[reader.node].input) == ["gone:output:0"]
    _assert_index_is_current(fg)
