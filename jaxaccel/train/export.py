"""A run folder as a Hugging Face checkpoint (``jaxaccel export``), which transformers'
``from_pretrained`` loads: the model of the run's newest readable checkpoint written by its
family's writer (``models.save_checkpoint``: BERT as ``BertForSequenceClassification``, Llama
as ``LlamaForCausalLM``, ViT as ``ViTForImageClassification`` or ``ViTMAEForPreTraining``),
the run's label names as config.json's ``id2label`` / ``label2id``, and the files of its
``tokenizer/`` folder beside them (``AutoTokenizer`` loads them; a ViT run has none; an images
run's ``preprocessor_config.json`` instead, which ``AutoImageProcessor`` loads).

Only what transformers computes as the run does is written: a model its class would run with
other outputs (the writers' ``differences``) is refused with the reason, never exported, unless
asked for in one of two explicit ways:

* ``custom_code``: a classifier of mean pooling (the README's main job, bfsong_finetune), of
  which transformers has no class, is written with a class of its own
  (``models.remote_code``: a ``modeling_*.py`` in the folder, named by config.json's
  ``auto_map``), which ``AutoModelFor...from_pretrained(out, trust_remote_code=True)`` loads;
  without ``trust_remote_code`` transformers refuses the folder.
* ``encoder``: a ViT run's encoder alone as transformers' ``ViTModel`` (its family's
  ``encoder_writer``, ``hf_vit.save_encoder``), exact for any grid: what an MAE pretraining
  run is exported for (its windowed or non-square decoder, which transformers' ViT-MAE cannot
  run, left out).

The checkpoint holds the per-parameter form whatever layout or pipeline trained it
(``forms.portable``), so every run exports. Parameters are float32 under every policy and
are written so; an fp8 run's scaling state (amax histories) is no part of a transformers
checkpoint, which runs the weights unquantized (the outputs of the run's model under the fp32
policy).

The export is written into a temporary folder beside ``out`` and renamed into place once
complete, so an interrupted or refused export leaves nothing; ``out`` in a bucket (``gs://``,
``s3://``) is uploaded once complete, config.json last. ``out`` must be missing or empty
unless ``overwrite`` (which replaces it), and may not be, or hold, the run folder.

    summary = export_run("runs/minilm_rt", "hf/minilm_rt", custom_code=True)
    summary = export_run("runs/bfsong_mae", "hf/bfsong_mae_encoder", encoder=True)
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

from jaxaccel import storage
from jaxaccel.models import hf, save_checkpoint
from jaxaccel.models.family import FamilyModel
from jaxaccel.data.images import PROCESSOR_FILE
from jaxaccel.train.inference import kept_processor, tokenizer_dir
from jaxaccel.train.saved import load_run

log = logging.getLogger("jaxaccel")


def export_run(run_dir: str, out: str, *, overwrite: bool = False, custom_code: bool = False,
               encoder: bool = False) -> dict:
    """Write the run folder's newest checkpoint to ``out`` (module doc); returns what was
    written: the folder, the transformers class, the step, the label names, the tokenizer's
    files and the model code shipped (``custom_code``'s ``modeling_*.py``, else none)."""
    storage.check(out, "--out")
    out = storage.absolute(out)
    _check_out(_real(run_dir), _real(out), overwrite)
    if storage.is_url(out):
        storage.makedirs(out)
        staging = tempfile.mkdtemp(prefix="jaxaccel-export-")
    else:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.export-",
                                   dir=os.path.dirname(out))
    try:
        model, _, meta = load_run(run_dir)
        _write_model(model, staging, custom_code, encoder)
        config = _set_label_names(staging, run_label_names(meta))
        reads_tokens = "input_ids" in type(model).input_keys
        copied = _copy_files(tokenizer_dir(run_dir), staging) if reads_tokens else \
            _copy_processor(run_dir, staging)
        _usual_permissions(staging)
        _publish(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if model.policy.fp8:
        log.info("fp8 run: exported its float32 parameters; the fp8 scaling state is no part "
                 "of a transformers checkpoint, which runs the weights unquantized.")
    code = _model_code(config)
    if code:
        log.info("%s ships its own model class (%s): transformers loads it with %s."
                 "from_pretrained(%r, trust_remote_code=True).", out, ", ".join(code),
                 _auto_class(config), out)
    return {"out": out, "architectures": config["architectures"],
            "step": meta.get("step"), "run_dir": storage.absolute(run_dir),
            "labels": list(config["id2label"].values()) if "id2label" in config else None,
            "tokenizer_files": copied, "model_code": code}


def run_label_names(meta: dict) -> tuple[str, ...]:
    """The run's class names as its checkpoint record ``meta`` keeps them; () where it has
    none (a language model, or a run saved before they were kept)."""
    return tuple(meta.get("label_names") or ())


def _write_model(model: FamilyModel, path: str, custom_code: bool, encoder: bool) -> None:
    """The run's model as a transformers checkpoint at ``path``: whole, exactly (a model of
    mean pooling with its own class under ``custom_code``), or its encoder alone (its family's
    ``encoder_writer``: a ViT's)."""
    if not encoder:
        save_checkpoint(model, path, exact=True, custom_code=custom_code)
        return
    family = model.spec.family
    if family.encoder_writer is None:
        raise ValueError("--encoder writes a ViT run's encoder alone (as transformers' "
                         f"ViTModel); this run is a {family.name} model, whose family writes "
                         "no encoder alone: export it whole (without --encoder).")
    family.resolve("encoder_writer")(model, path)


def _real(path: str) -> str:
    return path if storage.is_url(path) else os.path.realpath(path)


def _publish(staging: str, out: str) -> None:
    """Put the complete export in ``staging`` at ``out`` (replacing what is there: allowed by
    ``_check_out``): renamed into place on a local disk; in a bucket uploaded with config.json
    last, so that an interrupted upload leaves no folder that ``from_pretrained`` loads."""
    if not storage.is_url(out):
        if os.path.isdir(out) and os.listdir(out):
            shutil.rmtree(out)
        os.replace(staging, out)
        return
    storage.rmtree(out)
    config = os.path.join(staging, "config.json")
    held = tempfile.mkdtemp(prefix="jaxaccel-export-config-")
    try:
        shutil.move(config, held)
        storage.upload(staging, out)
        storage.upload(held, out)
    finally:
        shutil.rmtree(held, ignore_errors=True)


def _check_out(run_dir: str, out: str, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, the run folder or a folder holding it, or a non-empty
    folder without ``overwrite``, before anything is read."""
    if storage.exists(out) and not storage.isdir(out):
        raise ValueError(f"--out {out!r} is a file; name a folder to write the checkpoint into.")
    sep = "/" if storage.is_url(out) else os.sep
    if run_dir == out or run_dir.startswith(out.rstrip(sep) + sep):
        raise ValueError(f"--out {out!r} is or holds the run folder {run_dir!r}; name another "
                         "folder (e.g. hf/NAME).")
    if storage.listdir(out) and not overwrite:
        raise ValueError(f"--out {out!r} is not empty; name a new or empty folder, or pass "
                         "--overwrite to replace it.")


def _set_label_names(path: str, names) -> dict:
    """config.json of the checkpoint at ``path``, a classifier's class names (its ``id2label``:
    the writer's ``LABEL_i``) set to the run's ``names`` where it has them; returns it."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        config = json.load(f)
    if "id2label" in config:
        config.update(hf.labels_json(len(config["id2label"]), names))
        with open(file, "w") as f:
            json.dump(config, f, indent=2)
    return config


def _model_code(config: dict) -> list[str]:
    """The model code files config.json's ``auto_map`` names (``custom_code``), sorted."""
    return sorted({ref.split(".")[0] + ".py" for ref in config.get("auto_map", {}).values()})


def _auto_class(config: dict) -> str:
    """The transformers Auto class of the model ``auto_map`` names (not its config's)."""
    return next(k for k in config["auto_map"] if k != "AutoConfig")


def _usual_permissions(folder: str) -> None:
    """Give ``folder`` and its files the permissions the umask gives a new folder and file:
    ``mkdtemp`` makes the folder private (0700), safetensors its files (0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


def _copy_processor(run_dir: str, dest: str) -> list[str]:
    """The run's image processor config (an images run keeps one) copied into ``dest``."""
    if not kept_processor(run_dir):
        return []
    with open(os.path.join(dest, PROCESSOR_FILE), "wb") as f:
        f.write(storage.read_bytes(storage.join(run_dir, PROCESSOR_FILE)))
    return [PROCESSOR_FILE]


def _copy_files(source: str, dest: str) -> list[str]:
    """Copy the files of the folder ``source`` into ``dest``; their names, sorted."""
    names = sorted(n for n in os.listdir(source) if os.path.isfile(os.path.join(source, n)))
    for name in names:
        shutil.copy2(os.path.join(source, name), os.path.join(dest, name))
    return names


__all__ = ["export_run"]
