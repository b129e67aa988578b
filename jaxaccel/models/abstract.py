"""A model built abstractly (``nnx.eval_shape``: shapes, dtypes and partitioning, no values),
as plans, ``jaxaccel compile`` and a saved run's restore build it, at a cost linear in its size.

Flax draws every initialiser's key from an ``nnx.Rngs`` whose counter it updates with
``variable[...] = count + 1``; the update compares the new value's ``sharding`` with the old
one's by ``getattr(value, "sharding", None)``. Under a trace the value is a tracer, and jax
0.10's ``Tracer.sharding`` raises an AttributeError whose message it builds by walking the
whole trace so far back to the value's origin (``_origin_msg``): every key draw costs the size
of the model traced before it, so building the model costs the square of its size (BERT-base
1.4 CPU s, 0.6 without the walk; a 70B Llama's 80 layers ~15 CPU s). jax 0.12 raises the same
AttributeError without the walk. For the length of the build, ``eval_shape`` gives tracers
jax 0.12's short error where the installed jax builds the long one; ``getattr`` with a default
swallows either, so only the message of an error nobody sees changes.
"""
from __future__ import annotations

import contextlib

from flax import nnx
from jax._src import core


def _walks_the_trace() -> bool:
    """Whether this jax's ``Tracer.sharding`` builds the origin message (reads its code's
    names: a jax whose getter does something else is left alone)."""
    getter = getattr(core.Tracer, "sharding", None)
    return isinstance(getter, property) and "_origin_msg" in getter.fget.__code__.co_names


def _no_sharding(self):
    raise AttributeError(f"The 'sharding' attribute is not available on {self._error_repr()}.")


@contextlib.contextmanager
def _short_sharding_errors():
    if not _walks_the_trace():
        yield
        return
    original = core.Tracer.sharding
    core.Tracer.sharding = property(_no_sharding)
    try:
        yield
    finally:
        core.Tracer.sharding = original


def build_abstract(make):
    """``nnx.eval_shape(make)``: the module ``make()`` builds, every array a ShapeDtypeStruct."""
    with _short_sharding_errors():
        return nnx.eval_shape(make)
