"""A run's data beside its model: described when the run is resolved (what the data is, for
the model that reads it), its tokenizer and batches made when the run is assembled.

    described = describe_data(cfg, spec, devices)     # resolve: a DataSpec, nothing read
    fields = batches(r, tokenizer_dir)                # assemble: tokenizer, both splits
"""
from __future__ import annotations

import dataclasses

from jaxaccel import sharding as shd, storage
from jaxaccel.config import Config
from jaxaccel.data import load_tokenizer, run_tokenizer, splits
from jaxaccel.data import sources as data_sources
from jaxaccel.data.spec import Batching, DataSpec, ModelInput
from jaxaccel.models import ModelSpec, check_vocab, checkpoint_of


def model_input(cfg: Config, spec: ModelSpec, tokenizer: str | None = None) -> ModelInput:
    """What the model of ``spec`` reads, as its data is told (``data.spec.ModelInput``): its
    inputs, task and classes, and the tokenizer folder it names (``tokenizer``, a trained
    run's; else ``model.tokenizer`` or the checkpoint's; None: the model's default, or a
    corpus's own BPE); for pixels, the folder of the image processor's config
    (``tokenizer``: a trained run's folder; else ``model.checkpoint``)."""
    model_cls = spec.family.model_class()
    arch = spec.architecture
    if "pixels" in model_cls.input_keys:
        shape = tuple(model_cls.input_shapes(arch, None)["pixels"][0])
        return ModelInput(cfg.model.name, spec.task, "pixels", shape,
                          num_labels=cfg.model.num_labels, vocab_size=None,
                          processor=tokenizer or checkpoint_of(cfg.model) or None)
    named = tokenizer or storage.local_copy(cfg.model.tokenizer) or checkpoint_of(cfg.model) \
        or None
    return ModelInput(cfg.model.name, spec.task, "tokens", None, arch.max_position_embeddings,
                      cfg.model.num_labels, named, arch.vocab_size)


def describe_data(cfg: Config, spec: ModelSpec, devices: int, tokenizer: str | None = None,
                  label_names: tuple[str, ...] | None = None,
                  absent_ok: bool = False) -> DataSpec:
    """The run's data (``data.sources.describe``): the config's ``data`` section for the model
    of ``spec``, batched as the ``train`` section says over ``devices`` devices."""
    t = cfg.train
    batching = Batching(t.batch_size, t.eval_batch_size, cfg.seed, devices)
    described = data_sources.describe(cfg.data, batching, model_input(cfg, spec, tokenizer),
                                      absent_ok=absent_ok)
    if label_names:
        described = dataclasses.replace(described, label_names=tuple(label_names))
    return described


def tokenizer_of(r, model_tokenizer_dir: str | None, light: bool = False):
    """The run's tokenizer (``run_tokenizer.tokenizer_dir``: the model's, or a corpus's own BPE),
    checked against the model's vocabulary; None for data that is not text."""
    folder = run_tokenizer.tokenizer_dir(r.data, model_tokenizer_dir)
    if folder is None:
        return None
    tokenizer = load_tokenizer(folder, light=light)
    check_vocab(len(tokenizer), r.spec.architecture, folder)
    return tokenizer


def batches(r, tokenizer_dir: str) -> dict:
    """A training run's tokenizer and both splits' batches (``Run`` fields)."""
    tokenizer = tokenizer_of(r, tokenizer_dir)
    share = shd.batch_share(r.mesh)
    train_data, label_names = splits.train_batches(r.data, tokenizer, share)
    eval_data, _ = splits.eval_batches(r.data, tokenizer, share, label_names)
    return dict(eval_data=eval_data, tokenizer=tokenizer, label_names=label_names,
                train_data=train_data)
