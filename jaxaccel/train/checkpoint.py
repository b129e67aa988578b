"""Orbax checkpoints of the train state plus a small JSON record (data position, config).

Writes are atomic: Orbax writes into a temporary folder and renames it when complete, so an
interrupted write leaves the previous checkpoint as the latest readable one (unfinished
temporary folders are ignored and cleaned up). Saving is synchronous here, so that a SIGTERM
handler or a NaN stop can rely on what is on disk. Restores go straight to the shardings of
the abstract state given, so a checkpoint saved on one mesh restores onto another.

A train state is saved as ``on_disk(state)``: its optimizer state in the per-parameter form
(``jaxaccel.optim.portable_state``), which no mesh, device count or optimizer impl shapes;
``restore_state`` reads it back into the layout and shardings of a target state.
"""
from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from jaxaccel.optim import AdanState, portable_state, restore_layout, state_shardings


class Checkpointer:
    def __init__(self, directory: str, keep: int = 2):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                               enable_async_checkpointing=False,
                                               cleanup_tmp_directories=True)
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

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

    def restore_params(self, step: int | None = None, item: str = "params"):
        """``(params, meta)``: only the parameters of checkpoint ``step`` (default latest), as
        nested dicts with string keys on this process's first device, whatever mesh and
        device count wrote them: what evaluation and prediction need. ``item="fp8"`` reads the
        fp8 scaling state instead (fp8 runs)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}.")
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        saved = self._mngr.item_metadata(step)["state"][item]
        target = {item: jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)}
        restore_args = jax.tree_util.tree_map(lambda _: ocp.ArrayRestoreArgs(sharding=device),
                                              target)
        state = ocp.PyTreeCheckpointer().restore(
            os.path.join(self.directory, str(step), "state"),
            args=ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=True))
        meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return state[item], meta.meta

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


def on_disk(state):
    """What a checkpoint holds: the train state with a mesh-independent optimizer state (only
    flat multi-tensor states are converted; the rest is saved as it is, without a copy)."""
    return state.replace(opt_state=portable_state(state.opt_state))


def restore_state(ckpt: Checkpointer, state, shardings, step: int | None = None):
    """``(state, meta)`` of checkpoint ``step`` (default latest) laid out and placed like
    ``state`` with ``shardings`` (the target run's train state and its shardings), whatever mesh
    it was saved from; ``None`` if there is no checkpoint."""
    saved = jax.eval_shape(on_disk, state)

    def placed(target, target_shardings, on_disk_form):
        """Converted (flat Adan) states come back sharded like the parameters; the rest is
        saved as it is in memory and placed like the target."""
        if isinstance(target, AdanState) and target.layout is not None:
            return state_shardings(on_disk_form, shardings.params, shardings.step.mesh)
        return target_shardings
    disk = shardings.replace(opt_state=jax.tree_util.tree_map(
        placed, state.opt_state, shardings.opt_state, saved.opt_state,
        is_leaf=lambda x: isinstance(x, AdanState)))
    out = ckpt.restore(abstract_like(saved, disk), step)
    if out is None:
        return None
    restored, meta = out
    return restored.replace(opt_state=restore_layout(restored.opt_state, state.opt_state)), meta
