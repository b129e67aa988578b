"""Parameter forms: the arrangements a train state holds a parameter tree in (and every tree
shaped like it: gradients, optimizer moments, the fp8 state), and the one protocol that turns
each back into the per-layer tree.

The per-layer form is the model's own tree (``nnx.split``: ``{"embed_tokens": ...,
"layers": {0: {...}, 1: {...}}, ...}``): what checkpoints hold, what Hugging Face checkpoints
map to, what evaluation, prediction and sampling read. The other forms:

* flat (``forms.flat``): leaves packed into [rows, 128] buffers per device, one per (weight
  decay, dtype) group (``forms.packing.Packing``): ``FlatParams``, the parameters of the flat
  layout (``train.layout.FLAT``), and ``Packed``, an optimizer moment of the multi-tensor
  Adan;
* stacked (``forms.stacked``): the layers' trees stacked into arrays with leading dimensions
  (``Stacking``): the pipeline's [stages, repeats, group] (``train.pipeline.Stages``) and the
  scan's [layers] (``models.stack.Scan``).

A form is a pytree node (a subclass of ``Form``) whose leaves are arrays: optax maps over it,
so an optimizer's state mirrors whatever form its parameters take without knowing it, and
the caller places that state (``shardings``). What the forms have in common is this module's
protocol: ``portable`` (the per-layer form), ``restore`` (back, on any mesh) and the
shardings of both. Forms nest: a flat layout packs stacked parameters, and each converts in
turn.
"""
from __future__ import annotations

import jax


class Form:
    """A pytree node holding parameter-shaped data in an arrangement of its own. Subclasses
    say how it converts to and from the per-layer form, and where its arrays live."""

    def portable(self):
        """This node in the per-layer form."""
        raise NotImplementedError

    def from_portable(self, saved):
        """``saved`` (this node's per-layer form) in this node's form, placed as this node's
        arrays are placed (where they are)."""
        raise NotImplementedError

    def portable_shardings(self, shardings):
        """The shardings of ``self.portable()``, given this node's own ``shardings``."""
        raise NotImplementedError

    def shardings(self, given, mesh):
        """Where this node's arrays live on ``mesh``; ``given`` is the placement its caller
        derived by mirroring the parameters' (kept by default)."""
        return given


def is_form(x) -> bool:
    return isinstance(x, Form)


def portable(tree):
    """``tree`` with every form in it in the per-layer form (anything else as it is, without
    a copy); a form's per-layer form may hold forms of another kind (flat buffers of stacked
    parameters): those are converted in turn."""
    return jax.tree_util.tree_map(lambda x: portable(x.portable()) if is_form(x) else x, tree,
                                  is_leaf=is_form)


def restore(saved, like):
    """Inverse of ``portable``: ``saved`` with the forms of ``like`` (a tree of the same kind,
    or its ``jax.eval_shape``) restored, on whatever mesh ``like`` is placed on."""
    return jax.tree_util.tree_map(lambda t, s: t.from_portable(s) if is_form(t) else s,
                                  like, saved, is_leaf=is_form)


def portable_shardings(like, shardings):
    """The shardings of ``portable(like)``, given ``like``'s own ``shardings``: the forms'
    per-layer trees sharded like the parameters, the rest as given."""
    def one(node, given):
        if not is_form(node):
            return given
        inner = node.portable_shardings(given)
        return portable_shardings(inner, inner)
    return jax.tree_util.tree_map(one, like, shardings, is_leaf=is_form)


def shardings(tree, given, mesh):
    """Where the arrays of ``tree`` (or its ``eval_shape``) live on ``mesh``: ``given`` (a
    matching tree of shardings, mirrored from the parameters'), with each form's own
    placement (``Form.shardings``) where it has one."""
    return jax.tree_util.tree_map(lambda t, g: t.shardings(g, mesh) if is_form(t) else g,
                                  tree, given, is_leaf=is_form)


__all__ = ["Form", "is_form", "portable", "portable_shardings", "restore", "shardings"]
