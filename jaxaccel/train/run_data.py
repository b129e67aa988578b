"""A run's data beside its model: described when the run is resolved (what the data is, for
the model that reads it, and the one tokenizer it is read with), its tokenizer loaded and its
batches made when the run is assembled.

    described = describe_data(cfg, spec, devices)     # resolve: a DataSpec, checked
    tokenizer = tokenizer_of(described, spec.architecture)   # loaded and checked, here only
    fields = batches(r)                               # assemble: tokenizer, both splits
"""
from __future__ import annotations

import dataclasses
import functools

from jaxaccel import sharding as shd, storage
from jaxaccel.config import Config
from jaxaccel.data import load_tokenizer, run_tokenizer, splits
from jaxaccel.data import sources as data_sources
from jaxaccel.data.spec import Batching, DataSpec, ModelInput
from jaxaccel.models import ModelSpec, check_vocab, checkpoint_of, default_tokenizer_dir


def model_input(cfg: Config, spec: ModelSpec, tokenizer: str | None = None) -> ModelInput:
    """What the model of ``spec`` reads, as its data is told (``data.spec.ModelInput``): its
    inputs, task and classes, and the tokenizer folder it names (``tokenizer``, a trained
    run's; else ``model.tokenizer`` or the checkpoint's; None: it names none); for pixels, the
    folder of the image processor's config (``tokenizer``: a trained run's folder; else
    ``model.checkpoint``)."""
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


def tokenizer_folder(data: DataSpec, absent_ok: bool = False) -> str | None:
    """The run's tokenizer folder (``DataSpec.tokenizer``), decided here and nowhere else: the
    one the model names (``ModelInput.tokenizer``); else for a corpus its own BPE of
    ``data.tokenizer_vocab`` tokens (``run_tokenizer.bpe_folder``, trained when first read);
    else the model's default vocabulary (``models.default_tokenizer_dir``). None for data that
    is not text, and where nothing is named for a plan (``absent_ok``: no tokens are read, so
    the default's package need not be installed) or for a corpus that is not here."""
    if data.holds != "text":
        return None
    if data.model.tokenizer:
        return data.model.tokenizer
    if run_tokenizer.trains_bpe(data):
        return run_tokenizer.bpe_folder(data) if data.reader is not None else None
    return None if absent_ok else default_tokenizer_dir()


def describe_data(cfg: Config, spec: ModelSpec, devices: int, tokenizer: str | None = None,
                  label_names: tuple[str, ...] | None = None, absent_ok: bool = False,
                  training: bool = False) -> DataSpec:
    """The run's data (``data.sources.describe``): the config's ``data`` section for the model
    of ``spec``, batched as the ``train`` section says over ``devices`` devices, with the run's
    tokenizer folder (``tokenizer_folder``), checked against the model's task; for a run that
    trains, its BPE's size checked and its epoch read from a prepared cache where the data
    does not say it (``splits.prepared``)."""
    t = cfg.train
    batching = Batching(t.batch_size, t.eval_batch_size, cfg.seed, devices)
    described = data_sources.describe(cfg.data, batching, model_input(cfg, spec, tokenizer),
                                      absent_ok=absent_ok)
    if label_names:
        described = dataclasses.replace(described, label_names=tuple(label_names))
    data_sources.check_task(described)
    described = dataclasses.replace(described, tokenizer=tokenizer_folder(described, absent_ok))
    if not training:
        return described
    run_tokenizer.check_tokenizer_vocab(described)
    return splits.prepared(described, functools.partial(tokenizer_of, described,
                                                        spec.architecture))


def tokenizer_of(data: DataSpec, architecture, light: bool = False):
    """The run's tokenizer (``run_tokenizer.tokenizer_dir``: ``DataSpec.tokenizer``, a corpus's
    BPE trained there the first time), loaded (``light``: for reading only) and checked
    against the model's vocabulary: where every command gets it. None for data that is not
    text."""
    folder = run_tokenizer.tokenizer_dir(data)
    if folder is None:
        return None
    tokenizer = load_tokenizer(folder, light=light)
    check_vocab(len(tokenizer), architecture, folder)
    return tokenizer


def batches(r) -> dict:
    """A training run's tokenizer and both splits' batches (``Run`` fields)."""
    tokenizer = tokenizer_of(r.data, r.spec.architecture)
    share = shd.batch_share(r.mesh)
    train_data, label_names = splits.train_batches(r.data, tokenizer, share)
    eval_data, _ = splits.eval_batches(r.data, tokenizer, share, label_names)
    return dict(eval_data=eval_data, tokenizer=tokenizer, label_names=label_names,
                train_data=train_data)
