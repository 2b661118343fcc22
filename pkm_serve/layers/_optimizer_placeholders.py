"""The names of pkm_serve's optimizers under the JAX and PyTorch Keras backends.

`pkm_serve.optimizers` runs TF ops, so only the TF backend registers it. A `.keras` file compiled
with one of its optimizers then failed to load elsewhere with Keras' "Could not locate class";
these placeholders, registered under the same names, say what to do instead.
"""
import keras


def _tensorflow_only(name):
    def refuse(*args, **kwargs):
        raise ValueError(
            f"pkm_serve.optimizers.{name} runs on the TensorFlow Keras backend only, not under "
            f"{keras.backend.backend()!r}. Load a model compiled with it by keras.models.load_model(path, "
            "compile=False) and compile it with a Keras optimizer (e.g. keras.optimizers.Adam), or load it "
            "under KERAS_BACKEND=tensorflow.")

    return type(name, (), {"__init__": refuse, "from_config": classmethod(refuse), "get_config": refuse,
                           "__doc__": f"Placeholder: pkm_serve.optimizers.{name} is TF-only."})


LazyAdam = keras.saving.register_keras_serializable(package="pkm_serve")(_tensorflow_only("LazyAdam"))
RowwiseAdagrad = keras.saving.register_keras_serializable(package="pkm_serve")(_tensorflow_only("RowwiseAdagrad"))
