"""pkm_serve.serving: a model server speaking TensorFlow Serving's gRPC and REST APIs.

Entry point: `pkm-serve serve ...` -> pkm_serve.serving.server.main(argv), also
`python -m pkm_serve.serving`. This package file imports nothing, so no module of
the package imports back into it (no import circle), and `--help` and argument
errors do not pay for importing TensorFlow.
"""
