"""The product-key search's top-k under JAX as one primitive whose lowering picks how it ranks, so that
what runs where is decided when the computation is lowered, not when it is traced.

Executed, it lowers to lax.top_k (fast). Lowered for an export (jax.export, jax2tf, model.export:
lowering parameters marked for_export) it lowers to a stable sort (plain StableHLO), since JAX 0.10
serialises lax.top_k as a CHLO composite that TF 2.21's XlaCallModule cannot read. A choice made at
trace time was kept by jax.jit's trace cache: a jitted function called once, then exported, exported
lax.top_k. Both rank -0.0 as 0.0 and put ties at the lowest index; the indices come out ascending."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

_top_k_indices_p = Primitive("pkm_top_k_lowest_ties_indices")


def top_k_indices(scores, k: int):
    """int32 indices [..., k] of the k largest scores along the last axis (ties to the lowest index,
    -0.0 tied with 0.0), in ascending index order. Integer outputs: no gradient flows through them."""
    return _top_k_indices_p.bind(jax.lax.stop_gradient(scores), k=int(k))


def _by_top_k(scores, *, k):
    ranked = jnp.where(scores == 0, jnp.zeros_like(scores), scores)   # top_k puts 0.0 above -0.0
    index = jax.lax.top_k(ranked, k)[1]
    ascending = jax.lax.top_k(-index, k)[1]   # k distinct indices: no ties
    return jnp.take_along_axis(index, ascending, axis=-1)


def _by_sort(scores, *, k):
    index = jnp.argsort(scores, axis=-1, descending=True, stable=True)[..., :k]   # (ties -0.0 and 0.0)
    return jnp.sort(index, axis=-1)


def _abstract_eval(scores, *, k):
    return jax.core.ShapedArray(scores.shape[:-1] + (k,), jnp.int32)


def _lower(ctx, scores, *, k):
    exporting = ctx.module_context.lowering_parameters.for_export
    return mlir.lower_fun(functools.partial(_by_sort if exporting else _by_top_k, k=k),
                          multiple_results=False)(ctx, scores)


def _batch(args, dims, *, k):
    (scores,), (dim,) = args, dims
    return _top_k_indices_p.bind(jnp.moveaxis(scores, dim, 0), k=k), 0


def _jvp(primals, tangents, *, k):
    out = _top_k_indices_p.bind(*primals, k=k)
    return out, ad.Zero(jax.typeof(out).to_tangent_aval())


_top_k_indices_p.def_impl(jax.jit(_by_top_k, static_argnames="k"))
_top_k_indices_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_top_k_indices_p, _lower)
batching.primitive_batchers[_top_k_indices_p] = _batch
ad.primitive_jvps[_top_k_indices_p] = _jvp
