"""The config's value rules: what is wrong whatever it configures (ranges, divisibility),
checked on every config built (``config.build``) before anything is built from it.

Which names a choice takes (optimizer, policy, attention kernel) is checked by the part that
owns the choice, when a run is resolved (``jaxaccel.train.run.resolve``): the schema does not
import what it configures. Each section has its function; ``validate`` runs them all.
"""
from __future__ import annotations

import os

from jaxaccel import storage


def validate(cfg) -> None:
    """Raise ValueError naming the first key whose value no run can take, and what it takes."""
    _check_run(cfg)
    _check_data(cfg.data)
    _check_mixture(cfg.data)
    _check_train(cfg.train, cfg.model)
    _check_precision(cfg.precision)
    _check_mesh(cfg.mesh)


def _at_least(values: dict, low, meaning: dict | None = None) -> None:
    """Each ``{key: value}`` >= ``low``; ``meaning``: what a key's value means, said with it."""
    for key, value in values.items():
        if value < low:
            said = f" ({meaning[key]})" if meaning and key in meaning else ""
            raise ValueError(f"{key}={value} must be >= {low}{said}.")


PATH_KEYS = ("workdir", "model.checkpoint", "model.init_from", "model.tokenizer",
             "data.train_files", "data.eval_files", "data.data_dir")
"""Keys that name paths: each a local path or a bucket URL (``jaxaccel.storage``; globs
comma-separated)."""


def _check_paths(cfg) -> None:
    """Each path key's URLs usable here (a known scheme, its extra installed), before anything
    is read or written."""
    for key in PATH_KEYS:
        section, _, name = key.rpartition(".")
        value = (cfg[section] if section else cfg)[name]
        for path in str(value or "").split(","):
            storage.check(path.strip(), key)



def _check_run(cfg) -> None:
    _check_paths(cfg)
    if not cfg.name or os.sep in cfg.name or cfg.name in (".", ".."):
        raise ValueError(f"name={cfg.name!r} must be a folder name (outputs go to "
                         "{workdir}/{name}), e.g. name=my_run.")
    _at_least({"seed": cfg.seed}, 0,
              {"seed": "the seed of initialisation, dropout and data order"})
    if cfg.seed >= 2 ** 32:
        raise ValueError(f"seed={cfg.seed} is outside [0, 2**32) = [0, {2 ** 32 - 1}] (a seed is "
                         "32 bits: 2**32 would initialise the model as seed 0 does); give a seed "
                         "in that range.")


def _check_data(d) -> None:
    _at_least({f"data.{key}": d[key] for key in ("synthetic_examples", "synthetic_seq_len",
                                                 "max_len", "pad_multiple", "tokenizer_vocab")}, 1)
    _at_least({f"data.{key}": d[key] for key in ("validation_size", "workers",
                                                 "train_examples", "train_tokens")}, 0)
    if storage.is_url(d.cache_dir or ""):
        raise ValueError(
            f"data.cache_dir={d.cache_dir!r}: the token cache lives on each host's own disk, "
            "where training reads its rows at every step; data files in a bucket are copied to "
            "the host and tokenized there. Give a local folder (or leave data.cache_dir empty "
            "for ~/.cache/jaxaccel/data).")
    if not 0 <= d.holdout < 1:
        raise ValueError(f"data.holdout={d.holdout} must be in [0, 1): the fraction of the "
                         "training split held out as the eval split (0: none).")
    if d.label_field == d.text_field:
        raise ValueError(f"data.label_field={d.label_field!r} is data.text_field too: each text "
                         "would be its own class; set data.label_field to the field holding the "
                         "label (e.g. data.label_field=sentiment).")
    if d.sample_rate < 1:
        raise ValueError(f"data.sample_rate={d.sample_rate} must be >= 1 (Hz).")
    if not 0 <= d.synthetic_min_len <= d.synthetic_seq_len:
        raise ValueError(f"data.synthetic_min_len={d.synthetic_min_len} must be 0 "
                         f"(fixed length) to data.synthetic_seq_len={d.synthetic_seq_len}.")


MIXTURE_KEYS = ("mixture", "max_len", "tokenizer_vocab")
"""The ``data`` keys that are a mixture's, not one of its sources' (one row length, one
tokenizer)."""


def _weight(value) -> bool:
    """Whether ``value`` is a weight a mixture takes: a finite number > 0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        0 < value < float("inf")


def _check_mixture(d) -> None:
    if d.name == "mixture" and not d.mixture:
        raise ValueError("data.name=mixture needs data.mixture, the sources mixed, e.g. "
                         "data.mixture=\"[{'name': 'canterbury', 'weight': 3}, {'name': "
                         "'files', 'train_files': 'notes/*.txt', 'weight': 1}]\".")
    if d.mixture and d.name != "mixture":
        raise ValueError(f"data.mixture is read with data.name=mixture only, not data.name="
                         f"{d.name!r}; set data.name=mixture, or drop data.mixture.")
    if not all(isinstance(part, dict) for part in d.mixture):
        raise ValueError(f"data.mixture={d.mixture!r}: each source is a dict of the data keys it "
                         "sets and its weight, e.g. {'name': 'canterbury', 'weight': 1}.")
    if any(part.get("name") in (None, "mixture") for part in d.mixture):
        raise ValueError(f"data.mixture={d.mixture!r}: each source names its data.name (a "
                         "source of the table, not mixture), e.g. {'name': 'canterbury', "
                         "'weight': 1}.")
    if any(not _weight(part.get("weight")) for part in d.mixture):
        raise ValueError(f"data.mixture's weights are "
                         f"{[part.get('weight') for part in d.mixture]}: each source needs a "
                         "weight > 0, its share of the training rows (weights 3 and 1: three "
                         "rows of the first to one of the second).")
    if any(set(part) & set(MIXTURE_KEYS) for part in d.mixture):
        raise ValueError(f"data.mixture={d.mixture!r}: {', '.join(MIXTURE_KEYS)} are the "
                         "mixture's own keys (one row length, one tokenizer), not a source's; "
                         "set them in the data section.")


def _check_train(t, model) -> None:
    _at_least({"train.batch_size": t.batch_size, "train.eval_batch_size": t.eval_batch_size,
               "train.grad_accum": t.grad_accum, "train.log_every": t.log_every,
               "train.keep_checkpoints": t.keep_checkpoints,
               "model.num_labels": model.num_labels,
               "model.pipeline_repeats": model.pipeline_repeats}, 1,
              {"train.keep_checkpoints": "a run keeps at least its latest checkpoint"})
    _at_least({"train.microbatches": t.microbatches, "train.loss_chunks": t.loss_chunks,
               "train.epochs": t.epochs,
               "train.max_steps": t.max_steps, "train.checkpoint_every": t.checkpoint_every,
               "train.weight_decay": t.weight_decay, "train.max_grad_norm": t.max_grad_norm}, 0,
              {"train.microbatches": "0: one per pipeline stage",
               "train.loss_chunks": "0: chunks where the logits would be the peak",
               "train.epochs": "0 when train.max_steps > 0 sets the length",
               "train.max_steps": "0: train.epochs decides",
               "train.checkpoint_every": "0: epoch ends and the end only",
               "train.weight_decay": "0: no weight decay",
               "train.max_grad_norm": "0: no clipping"})
    if t.epochs < 1 and t.max_steps < 1:
        raise ValueError(f"train.epochs={t.epochs} and train.max_steps={t.max_steps}: set one "
                         "of them >= 1.")
    if model.scan_layers not in (None, True, False):
        raise ValueError(f"model.scan_layers={model.scan_layers!r} must be true, false or "
                         "None (scanned on TPUs and GPUs with model.remat set).")
    unit = {"train.b1": t.b1, "train.b2": t.b2, "train.b3": t.b3,
            "model.hidden_dropout": model.hidden_dropout,
            "model.attention_dropout": model.attention_dropout}
    for key, value in unit.items():
        if value is not None and not 0 <= value < 1:
            raise ValueError(f"{key}={value} must be in [0, 1) (or None for the default).")
    if t.eps is not None and not t.eps > 0:
        raise ValueError(f"train.eps={t.eps} must be > 0 (or None for the default).")
    if not 0 <= t.warmup_ratio < 1:
        raise ValueError(f"train.warmup_ratio={t.warmup_ratio} must be in [0, 1).")
    if not t.learning_rate > 0:
        raise ValueError(f"train.learning_rate={t.learning_rate} must be > 0.")
    if not 0 < t.layer_decay <= 1:
        raise ValueError(f"train.layer_decay={t.layer_decay} must be in (0, 1]; 1 is no "
                         "layer-wise decay.")
    if t.batch_size % t.grad_accum:
        raise ValueError(f"train.batch_size={t.batch_size} is not divisible by "
                         f"train.grad_accum={t.grad_accum}.")


def _check_precision(p) -> None:
    _at_least({f"precision.{key}": p[key] for key in (
        "loss_scale_growth_interval", "max_consecutive_skips", "fp8_amax_history")}, 1)
    if p.loss_scale_init <= 0:
        raise ValueError(f"precision.loss_scale_init={p.loss_scale_init} must be > 0 "
                         "(e.g. 32768.0).")
    if p.logits_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"precision.logits_dtype={p.logits_dtype!r}: use 'float32' or "
                         "'bfloat16'.")
    if p.fp8_layers not in ("paying", "all"):
        raise ValueError(f"precision.fp8_layers={p.fp8_layers!r}: use 'paying' (the layers "
                         "large enough to be faster in fp8) or 'all'.")


def _check_mesh(mesh) -> None:
    _at_least({"mesh.dcn_data": mesh.dcn_data, "mesh.dcn_fsdp": mesh.dcn_fsdp}, 1,
              {"mesh.dcn_data": "mesh.data's ways between TPU slices",
               "mesh.dcn_fsdp": "mesh.fsdp's ways between TPU slices"})
    for axis, size in mesh.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh.{axis}={size}: use a positive size or -1 (fill).")
    if sum(1 for s in mesh.values() if s == -1) > 1:
        raise ValueError(f"mesh {dict(mesh)}: at most one axis may be -1.")
