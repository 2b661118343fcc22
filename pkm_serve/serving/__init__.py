"""pkm_serve.serving: a model server speaking TensorFlow Serving's gRPC and REST APIs.

Entry point: `pkm-serve serve ...` -> main(argv). Imports are lazy so that
`--help` and argument errors do not pay for importing TensorFlow.
"""


def main(argv=None):
    from pkm_serve.serving.server import main as _main
    return _main(argv)
