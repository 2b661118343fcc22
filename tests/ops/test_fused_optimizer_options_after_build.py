"""A gradient option set on an optimizer after it claimed a fused table (``optimizer.clipvalue =
0.5`` before a custom loop's step) is refused before the update, as at build: the fused update
never forms the gradient, and it applied the step unclipped (undecayed) without a word."""
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from pkm_serve.optimizers import RowwiseAdagrad  # noqa: E402
from tests.ops.test_fused_optimizer_misuse import IDS, fused_bag, one_step  # noqa: E402

OPTIONS = {"clipvalue": 1e-6, "clipnorm": 1e-6, "global_clipnorm": 1e-6, "weight_decay": 0.5}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_option_set_after_the_claim_is_refused_before_the_update(option, compiled):
    bag, optimizer = fused_bag()
    setattr(optimizer, option, OPTIONS[option])
    before = bag.embeddings.numpy()
    step = lambda: one_step(bag, optimizer, lambda layer: layer(IDS))  # noqa: E731
    with pytest.raises(ValueError, match=f"does not support {option}"):
        tf.function(step)() if compiled else step()
    np.testing.assert_array_equal(bag.embeddings.numpy(), before)


def test_rowwise_adagrad_refuses_it_too():
    bag, _ = fused_bag()  # the optimizer built last claims the table
    optimizer = RowwiseAdagrad(0.1)
    optimizer.build(bag.trainable_variables)
    optimizer.clipvalue = 1e-6
    with pytest.raises(ValueError, match="RowwiseAdagrad: .* does not support clipvalue"):
        one_step(bag, optimizer, lambda layer: layer(IDS))
