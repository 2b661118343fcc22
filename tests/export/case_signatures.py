"""Test cases as signatures of one SavedModel, exported once per module (as
test_export_position_bags.py does) instead of a save and an export per case.

A case's export error stays its own: where the export of all of a group's
signatures raises, each is exported alone, and only the cases whose own
export raises carry the error (re-raised by `Cases.get` in their test)."""
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import tensorflow as tf

from tensorflow.core.protobuf import saved_model_pb2

from pkm_serve import tflite
from pkm_serve.export import export_saved_model
from pkm_serve.tflite_model import flatbuffer_schema


def signature(name: str, specs, call):
    """tf.function of `call` whose sites' function is __inference_<name>_<n>."""
    call.__name__ = name
    return tf.function(input_signature=specs)(call)


@dataclass
class Export:
    result: object
    lite: Optional[str]
    sites: Dict[str, list]
    _loaded: dict = field(default_factory=dict)

    def fused(self, name: str):
        if "model" not in self._loaded:
            self._loaded["model"] = tf.saved_model.load(self.result.dst)
        return self._loaded["model"].signatures[name]

    def runner(self, name: str):
        if "lite" not in self._loaded:
            self._loaded["lite"] = tflite.make_interpreter(self.lite)
        return self._loaded["lite"].get_signature_runner(name)

    def custom_ops(self, name: str) -> List[str]:
        """The custom ops of signature `name`'s subgraph of the .tflite."""
        with open(self.lite, "rb") as f:
            model = flatbuffer_schema().Model.GetRootAsModel(bytearray(f.read()), 0)
        [index] = [model.SignatureDefs(i).SubgraphIndex() for i in range(model.SignatureDefsLength())
                   if model.SignatureDefs(i).SignatureKey().decode() == name]
        subgraph = model.Subgraphs(index)
        codes = {model.OperatorCodes(subgraph.Operators(i).OpcodeIndex()).CustomCode()
                 for i in range(subgraph.OperatorsLength())}
        return sorted(code.decode() for code in codes if code)


def sites_by_case(sites, names) -> Dict[str, list]:
    by_case: Dict[str, list] = {}
    for site in sites:
        owners = [n for n in names if re.fullmatch(rf"__inference_{n}_\d+", site.function)]
        assert len(owners) == 1, f"site in {site.function} belongs to no single case of {sorted(names)}"
        by_case.setdefault(owners[0], []).append(site)
    return by_case


@dataclass
class Case:
    """One case: its sites, its original and fused SavedModels and their signature `name`."""
    name: str
    sites: list
    src: object
    dst: str
    original: object
    fused: object

    def run_both(self, *args):
        """The original's and the fused model's output "out" for the signature's args in order."""
        inputs = {f"args_{i}": a for i, a in enumerate(args)}
        return self.original(**inputs)["out"].numpy(), self.fused(**inputs)["out"].numpy()


class Cases:
    """{case name: Export or the exception its export raised}; the originals' signatures."""

    def __init__(self):
        self.exports, self.originals, self.sources = {}, {}, {}

    def get(self, name: str) -> Export:
        export = self.exports[name]
        if isinstance(export, Exception):
            raise export
        return export

    def case(self, name: str) -> "Case":
        export = self.get(name)
        return Case(name, export.sites.get(name, []), self.sources[name], export.result.dst, self.original(name),
                    export.fused(name))

    def original(self, name: str):
        return self.originals[name].signatures[name]

    def add(self, out_dir, module, signatures, with_tflite=False, samples=None) -> None:
        """Saves `module` with `signatures` ({name: tf.function}) to out_dir/m and exports it
        once. One SavedModel per export: a load reads every function of the model, and the
        export loads it several times. `samples(original)`: {"SIGNATURE/input": array}."""
        out_dir.mkdir()
        tf.saved_model.save(module, str(out_dir / "m"), signatures=signatures)
        original = tf.saved_model.load(str(out_dir / "m"))
        self.originals.update(dict.fromkeys(signatures, original))
        self.sources.update(dict.fromkeys(signatures, out_dir / "m"))
        self.exports.update(export_cases(out_dir, list(signatures), with_tflite,
                                         samples(original) if samples else None))


def exported_bodies(out_dir, variables: dict, cases: dict):
    """`cases` ({name: (input specs, body(module, *inputs))}) as signatures returning {"out": body}
    of one tf.Module holding `variables` ({attribute: initial value}), exported once: Cases.case."""
    module = tf.Module()
    for attribute, value in variables.items():
        setattr(module, attribute, tf.Variable(value))

    def call(body):
        return lambda *args: {"out": body(module, *args)}

    exported = Cases()
    exported.add(out_dir, module, {name: signature(name, specs, call(body)) for name, (specs, body) in cases.items()})
    return exported.case

def export_cases(out_dir, names, with_tflite=False, samples=None) -> dict:
    """{name: Export or the exception its export raised} of out_dir/m's signatures `names`."""
    kw = {}
    if samples:
        np.savez(out_dir / "samples.npz", **samples)
        kw["sample_inputs"] = str(out_dir / "samples.npz")

    def export(tag, chosen):
        lite = str(out_dir / f"{tag}.tflite") if with_tflite else None
        result = export_saved_model(str(out_dir / "m"), str(out_dir / tag), signatures=chosen, tflite=lite,
                                    quiet=True, **kw)
        return Export(result, lite, sites_by_case(result.sites, names))

    try:
        shared = export("together", sorted(names))
        return {name: shared for name in names}
    except Exception:  # noqa: BLE001 -- some case's error: find whose, so only its test fails
        exports = {}
        for name in names:
            try:
                exports[name] = export(name, [name])
            except Exception as e:  # noqa: BLE001
                exports[name] = e
        return exports


class Served:
    """export_models.run_as_a_server's TF1 session (feeds of any shape, unchecked against the signature, as
    TF Serving runs them), loaded once for all the SavedModel's signatures instead of once per request."""

    def __init__(self, saved_model):
        proto = saved_model_pb2.SavedModel()
        with open(os.path.join(str(saved_model), "saved_model.pb"), "rb") as f:
            proto.ParseFromString(f.read())
        inputs = [info for sig in proto.meta_graphs[0].signature_def.values() for info in sig.inputs.values()]
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.holders = {info.name: tf.compat.v1.placeholder(tf.as_dtype(info.dtype), None) for info in inputs}
            self.session = tf.compat.v1.Session(graph=self.graph)
            meta = tf.compat.v1.saved_model.loader.load(self.session, ["serve"], str(saved_model),
                                                        input_map=self.holders)
        self.signatures = meta.signature_def

    def run(self, signature, feed, output="out"):
        sig = self.signatures[signature]
        with self.graph.as_default():
            out = self.graph.get_tensor_by_name(sig.outputs[output].name)
            return self.session.run(out, {self.holders[sig.inputs[k].name]: v for k, v in feed.items()})


_SERVED: Dict[str, Served] = {}


def run_served(saved_model, signature, feed, output="out"):
    """run_as_a_server's output through one Served session per SavedModel (each written once: a test
    session's temporary paths are not reused)."""
    key = os.path.abspath(str(saved_model))
    if key not in _SERVED:
        _SERVED[key] = Served(saved_model)
    return _SERVED[key].run(signature, feed, output)
