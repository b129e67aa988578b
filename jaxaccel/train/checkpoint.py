"""Orbax checkpoints of the train state plus a small JSON record (data position, config).

Writes are atomic: Orbax writes into a temporary folder and renames it when complete, so an
interrupted write leaves the previous checkpoint as the latest readable one (unfinished
temporary folders are ignored and cleaned up). Saving is synchronous here, so that a SIGTERM
handler or a NaN stop can rely on what is on disk. Restores go straight to the shardings of
the abstract state given, so a checkpoint saved on one mesh restores onto another.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str, keep: int = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False,
                                               cleanup_tmp_directories=True)
        self._mngr = ocp.CheckpointManager(self.directory, options=options,
                                           item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        if step in self._mngr.all_steps():
            return
        self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)))
        self._mngr.wait_until_finished()

    def restore(self, abstract_state, step: int | None = None):
        """``(state, meta)`` of ``step`` (default latest), or ``None`` if there is none.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with shardings (e.g. from
        ``jax.eval_shape`` plus the target shardings)."""
        step = self.latest_step() if step is None else step
        if step is None:
            return None
        out = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def restore_untyped(self, step: int | None = None):
        """``(state, meta)`` with the state as saved (nested dicts, string keys), without
        knowing the optimizer: what evaluation and prediction need."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}.")
        out = self._mngr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
        return out.state, out.meta

    def close(self) -> None:
        self._mngr.close()


def abstract_like(tree, shardings):
    """ShapeDtypeStructs of ``tree`` carrying ``shardings`` (a matching pytree)."""
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def like(template, restored):
    """Re-key ``restored`` (string keys, as Orbax gives untyped trees back) like ``template``."""
    if isinstance(template, dict):
        return {k: like(v, restored[str(k)]) for k, v in template.items()}
    if restored.shape != template.shape:
        raise ValueError(f"checkpoint tensor of shape {restored.shape} where the model has "
                         f"{template.shape}.")
    return restored
