"""TF Serving's signature method names and default signature key (shared by servable.py,
which replays warmup through service.py, and service.py: a module of their own so that
neither imports the other at load time)."""

DEFAULT_SIGNATURE = "serving_default"
PREDICT_METHOD = "tensorflow/serving/predict"
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
