"""pkm_serve: fused EmbeddingBag / Product-Key Memory ops for TensorFlow,
TF Serving and TFLite.

The TF op lives in ``pkm_serve.ops``; Keras layers in ``pkm_serve.layers``;
export (fusion) in ``pkm_serve.export``; the model server in
``pkm_serve.serving``; the TFLite delegate helpers in ``pkm_serve.tflite``.
Submodules are imported lazily so that, e.g., ``pkm_serve.tflite`` works in an
environment that has a TFLite runtime but no TensorFlow.
"""

__version__ = "0.1.0"
