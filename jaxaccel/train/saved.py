"""A run folder's trained model, read back: for evaluation, prediction and generation
(``jaxaccel.train.inference``), and to start another run from it (``model.init_from``: MAE
pretraining, then fine-tuning the encoder for classification)."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxaccel import config as config_lib, storage
from jaxaccel.models import build_model, fp8_settled, spec
from jaxaccel.models.abstract import build_abstract
from jaxaccel.models.fp8 import Fp8Meta
from jaxaccel.precision import policy_of
from jaxaccel.train import rundir
from jaxaccel.train.checkpoint import Checkpointer, like

log = logging.getLogger("jaxaccel")


def load_run(run_dir: str):
    """``(model, cfg, meta)``: the model of the run's newest readable checkpoint (with its
    fp8 scaling state under the fp8 policy), rebuilt from the model spec saved with it (the
    original HF checkpoint is not needed; runs saved before specs existed hold the bare
    architecture, and their options come from the saved config)."""
    ckpt = Checkpointer(storage.join(run_dir, "checkpoints"), read_only=True)
    try:
        saved, meta = ckpt.restore_items(("params", "fp8"))
        cfg = config_lib.build(meta["config"])
        # The layers it ran in fp8 (``Policy.fp8_dense``): those of the device it trained on.
        saved_spec = spec.from_saved(meta["architecture"], cfg.model)
        policy = fp8_settled(policy_of(cfg.precision, fp8_min_width=meta.get("fp8_min_width",
                                                                            0.0)), saved_spec)
        # Shapes only, no random initialisation: every value comes from the checkpoint; outside
        # any ambient mesh (init_from runs under the trainer's), whose axes are no logical ones.
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            model = build_abstract(lambda: build_model(saved_spec, policy))
        restored = [(nnx.Param, saved["params"])]
        if policy.fp8:
            restored.append((Fp8Meta, saved["fp8"]))
    finally:
        ckpt.close()
    for kind, values in restored:
        state = nnx.state(model, kind)
        nnx.replace_by_pure_dict(state, like(nnx.to_pure_dict(state), values))
        nnx.update(model, state)
    return model, cfg, meta


def init_from(model, run_dir: str) -> None:
    """Set ``model``'s parameters to those of the run folder's newest checkpoint where the path
    and shape agree (``model.init_from``): the embeddings and every layer must (else
    ``ValueError``: another architecture); what the run does not have, or has in another
    shape (a new head, e.g. a classifier on an MAE encoder), keeps its fresh initialisation
    and is logged. The run's task-specific parts (an MAE decoder) are left out. ``run_dir``
    is the folder or its checkpoints/ folder; every refusal names the key."""
    try:
        source, _, _ = load_run(rundir.run_folder(run_dir))
    except (OSError, ValueError) as e:
        raise ValueError(f"model.init_from={run_dir!r}: {e}") from e
    have = flatten_dict(nnx.to_pure_dict(nnx.state(source, nnx.Param)))
    state = nnx.state(model, nnx.Param)
    values = flatten_dict(nnx.to_pure_dict(state))
    taken, fresh = [], []
    for key, value in values.items():
        name = "/".join(map(str, key))
        old = have.get(key)
        if old is not None and tuple(old.shape) == tuple(value.shape):
            values[key] = jnp.asarray(old, value.dtype)
            taken.append(name)
        else:
            fresh.append(name)
    body = model.spec.family.embeddings + ("layers",)
    missing = [k for k in fresh if k.split("/")[0] in body]
    if missing:
        raise ValueError(f"model.init_from={run_dir!r}: the run's model has no parameter of "
                         f"the same shape for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
                         " of this model's embeddings and layers: another architecture. Start "
                         "from a run of the same model.name (or architecture).")
    nnx.replace_by_pure_dict(state, unflatten_dict(values))
    nnx.update(model, state)
    log.info("model.init_from=%s: %d parameters from the run, %d fresh (%s)", run_dir,
             len(taken), len(fresh), ", ".join(sorted({k.split("/")[0] for k in fresh})) or
             "none")


__all__ = ["init_from", "load_run"]
