"""The model-family contract: what the trainer, the layer stack, the planner, export and
inference call on a family's model class, written once (``FamilyModel``, the base class of
``BertModel``, ``LlamaForCausalLM`` and ``ViTModel``).

A family's model class ``Model(FamilyModel)`` is built as ``Model(spec, policy, rngs)``
(``spec.ModelSpec``, a ``precision.Policy`` or its name, ``nnx.Rngs``) and keeps ``spec``,
``config`` (the architecture) and ``policy``; its forward is embeddings -> ``layers`` (an
``nnx.List``, run through ``models.stack``) -> head. What it states:

* ``input_keys``: the batch keys it reads, in its call's positional order (a task calls
  ``model(*(batch[k] for k in input_keys), deterministic=, rngs=, stack=)``);
  ``input_shapes(architecture, length)`` their per-row shapes and dtypes (token rows of
  ``length`` by default).
* ``layer_call(layer, x, args, deterministic, rngs, rows) -> x``: one layer on the hidden
  states, ``args`` the per-batch inputs the forward hands its stack (``models.stack``, the
  pipeline's stages).
* ``FP8_GROUPS`` and ``fp8_stacks``: the metric group of each fp8 Dense layer's path inside a
  layer, and the parameter paths of the layer lists (``fp8_group``).
* ``flops_shape(spec)``: the shape the model FLOPs formula (``jaxaccel.flops``) reads.
* ``generates``: whether it decodes with a KV cache (``init_cache(batch, length)`` and a
  ``cache`` argument, ``models.generate``).

The family's entry in ``spec.FAMILIES`` names the class; its layers come from
``models.layers``.
"""
from __future__ import annotations

from typing import Any, ClassVar

import jax.numpy as jnp
from flax import nnx


class FamilyModel(nnx.Module):
    """The base class of a family's model class (module doc): the contract and its defaults."""

    input_keys: ClassVar[tuple[str, ...]]
    FP8_GROUPS: ClassVar[dict[tuple[str, ...], str]] = {}
    fp8_stacks: ClassVar[tuple[tuple[str, ...], ...]] = (("layers",),)
    generates: ClassVar[bool] = False

    @classmethod
    def input_shapes(cls, config, length: int | None) -> dict:
        """{key: (shape of one row, dtype)} of the inputs of rows of ``length`` tokens: int32
        token rows of every ``input_keys``, unless the family reads something else."""
        return {k: ((length,), jnp.int32) for k in cls.input_keys}

    @staticmethod
    def layer_call(layer, x, args, deterministic, rngs, rows=None):
        """One layer on ``x`` with the forward's per-batch ``args`` (``models.stack``)."""
        raise NotImplementedError

    @classmethod
    def fp8_group(cls, path: tuple) -> str | None:
        """The ``FP8_GROUPS`` group of a parameter path such as ``("layers", "3", "mlp",
        "up_proj")`` (a layer of one of ``fp8_stacks``), or None outside the layers."""
        for stack in cls.fp8_stacks:
            if tuple(path[:len(stack)]) == stack:
                return cls.FP8_GROUPS.get(tuple(path[len(stack) + 1:]))
        return None

    @staticmethod
    def flops_shape(spec) -> Any:
        """The ``jaxaccel.flops`` shape (``Shape``, ``ViTShape``) of a model of ``spec``."""
        raise NotImplementedError

    def init_cache(self, batch: int, length: int, dtype=None):
        """An empty KV cache of ``length`` slots per row (a family that ``generates``)."""
        raise NotImplementedError(f"{type(self).__name__} does not generate text.")


__all__ = ["FamilyModel"]
