"""Evaluation, prediction and generation from a run folder alone (its newest readable
checkpoint, the config and model spec saved with it, and its tokenizer/ folder). Checkpoints
are opened read-only, so these run safely beside the trainer writing the folder."""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxaccel import config as config_lib, storage
from jaxaccel.data import sources
from jaxaccel.data.images import PROCESSOR_FILE
from jaxaccel.data.inputs import input_batches, input_features
from jaxaccel.data.spec import Settings
from jaxaccel.models import spec as spec_lib
from jaxaccel.models.generate import Sampler
from jaxaccel.models.stack import merge
from jaxaccel.train import rundir
from jaxaccel.train.run import assemble, resolve
from jaxaccel.train.run_data import tokenizer_of
from jaxaccel.train.saved import load_run
from jaxaccel.train.step import forward


EVAL_SETTABLE = ("data", "mesh", "train.eval_batch_size")
"""What ``evaluate_run``'s overrides may set (a key or a section): the data evaluated on, the
devices and the eval batch. The model, its labels and its precision are the checkpoint's."""


EVAL_FIXED = {"data.tokenizer_vocab": "the texts are tokenized by the run's own tokenizer (its "
                                       "tokenizer/ folder), whatever vocabulary size is set"}
"""Keys of ``EVAL_SETTABLE``'s sections that evaluation cannot honour either, and why."""


def check_eval_sets(sets: list[str]) -> None:
    """``ValueError`` naming the first ``key=value`` evaluation cannot honour."""
    for text in sets:
        key, _ = config_lib.parse_override(text)
        if key in EVAL_FIXED:
            raise ValueError(f"eval cannot honour --set {text}: {EVAL_FIXED[key]}. Drop the "
                             "override, or train a run with that setting.")
        if not any(key == k or key.startswith(k + ".") for k in EVAL_SETTABLE):
            raise ValueError(
                f"eval cannot honour --set {text}: the model, its labels and its precision "
                "come from the checkpoint (and the rest of the config only shaped its "
                f"training). eval takes only {', '.join(EVAL_SETTABLE)} (and the keys in "
                "those sections); drop the override, or train a run with that setting.")


def check_eval_task(run_dir: str, sets: list[str]) -> None:
    """``ValueError`` if ``sets`` give data of another task than the run trained (a corpus
    for a classifier, a labelled dataset for a causal LM: a bare ``KeyError`` or a complaint
    about the tokenizer's EOS token otherwise), before anything is read (the data sources'
    rows say which tasks each serves: ``data.sources.SOURCES``)."""
    saved = rundir.saved_config(run_dir)
    if saved is None or not sets:
        return                    # load_run says what a folder without a config lacks
    trained, asked = config_lib.build(saved[0]), config_lib.build(saved[0], sets)
    task = spec_lib.from_config(trained.model).task
    serves = sources.source(asked.data.name).tasks
    if task not in serves:
        fix = {"causal_lm": "a corpus (e.g. data.name=canterbury)",
               "classification": "a labelled dataset (e.g. data.name=rt_snippets)",
               "mae": "an array dataset (e.g. data.name=bfsong)"}[task]
        raise ValueError(f"eval --set data.name={asked.data.name}: the run {run_dir!r} trained "
                         f"a {task} model (on data.name={trained.data.name!r}), but "
                         f"{asked.data.name!r} gives {'/'.join(serves)} batches; evaluate it "
                         f"on {fix}.")


def evaluate_run(run_dir: str, sets: list[str] | None = None, devices=None) -> dict:
    """The task's report (classification: accuracy, loss, per-class precision/recall/F1,
    macro-F1 and the confusion matrix, and the class names the run learnt or was given, in
    the lists' order; causal LM: loss and perplexity, ``tasks.TASKS``) of the run's latest
    checkpoint on its eval split, data parallel over
    ``devices`` (default all at hand, not the training mesh, which may need more) unless
    ``sets`` say (only ``EVAL_SETTABLE`` keys). Builds only the evaluation side
    (``checkpoint_run``): the model from the run folder, the eval split; no optimizer state,
    no training split."""
    check_eval_sets(sets or [])
    check_eval_task(run_dir, sets or [])
    run, meta = checkpoint_run(run_dir, sets or [], devices)
    with jax.set_mesh(run.mesh):
        result = run.evaluate()
    # Records before the step was saved with them give the data position (epoch, step in it).
    step = meta["step"] if "step" in meta else \
        meta["epoch"] * run.resolved.data.steps_per_epoch + meta["step_in_epoch"]
    result.update(step=step, split=run.resolved.data.eval_split, run_dir=run_dir)
    return result


def checkpoint_run(run_dir: str, sets=(), devices=None, *, data: bool = True):
    """``(run, meta)``: the eval-only ``Run`` of the run folder's newest readable checkpoint
    (``train.run.resolve`` and ``assemble``, as every command builds its run), data parallel
    over ``devices`` (default all) whatever mesh trained it, with ``sets`` applied; its eval
    split batched unless ``data`` is False (predict brings its own inputs: the data is then
    described, from the config alone where it is not on this machine, and not read). The
    checkpoint holds the per-parameter form whatever the trainer's layout or pipeline was."""
    model, trained, meta = load_run(run_dir)
    cfg = config_lib.build(trained.to_dict(), ["mesh.data=-1", "mesh.fsdp=1", "mesh.tensor=1",
                                           "mesh.stage=1", *sets])
    folder = kept_processor(run_dir) if reads_arrays(model.spec) else tokenizer_dir(run_dir)
    resolved = resolve(cfg, devices, training=False, spec=model.spec, tokenizer=folder,
                       label_names=meta.get("label_names") or None, absent_ok=not data)
    resolved = dataclasses.replace(resolved, data=dataclasses.replace(
        resolved.data, trained=Settings(trained.data)))
    return assemble(resolved, model=model, data=data), meta


def reads_arrays(spec) -> bool:
    """Whether the model of ``spec`` reads arrays (``pixels``) rather than tokens."""
    return "pixels" in spec.family.model_class().input_keys


def kept_processor(run_dir: str) -> str | None:
    """The run folder if it keeps an image processor's config (an images run's
    ``preprocessor_config.json``, ``DataSpec.run_files``), else None."""
    return run_dir if storage.exists(storage.join(run_dir, PROCESSOR_FILE)) else None


def tokenizer_dir(run_dir: str) -> str:
    """The run's tokenizer/ folder (in a bucket: its local copy, ``storage.local_copy``)."""
    path = storage.join(run_dir, "tokenizer")
    if not storage.isdir(path):
        raise FileNotFoundError(f"run folder {run_dir!r} has no tokenizer/ folder (runs "
                                "trained before tokenizers were saved with every run); copy "
                                "the tokenizer files of model.tokenizer/model.checkpoint there.")
    return storage.local_copy(path)


class Predictor:
    """``Predictor(run_dir)(inputs) -> [(label_name, probability, facts) or ValueError,
    ...]`` (``__call__``), at most ``batch_size`` inputs per forward pass, classified by the
    task's forward pass (``step.forward``); a non-finite probability comes back as ``nan``. A
    text model's inputs are texts, batched as evaluation batches are (``inputs.input_batches``:
    sorted by length, each batch padded by the run's ``data.pad_multiple``, the last one
    completed with filler rows); an array model's are files (e.g. WAV recordings), made into
    its inputs as its data makes its examples (``inputs.input_features``, which reads the
    training data's normalisation). With ``top_k`` = K, each input's ``facts`` also hold
    ``top_k``: the K likeliest labels, most likely first, each ``{"label", "probability"}``."""

    def __init__(self, run_dir: str, batch_size: int = 64, top_k: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1.")
        run, meta = checkpoint_run(run_dir, devices=jax.devices()[:1], data=False)
        cfg, task = run.cfg, run.task
        self.arrays = reads_arrays(run.spec)
        if task.name != "classification":
            use = "`jaxaccel eval`" if self.arrays else \
                "`jaxaccel generate` (or `jaxaccel eval`)"
            raise ValueError(f"run {run_dir!r} trained a {task.name} model; predict "
                             f"classifies {'files' if self.arrays else 'texts'}. Use {use}.")
        data = run.resolved.data
        self.batch_size = batch_size
        self.label_names = meta.get("label_names") or [str(i) for i in
                                                      range(cfg.model.num_labels)]
        if top_k is not None and not 1 <= top_k <= len(self.label_names):
            raise ValueError(f"--top-k {top_k}: the run {run_dir!r} has "
                             f"{len(self.label_names)} labels; give a K from 1 to "
                             f"{len(self.label_names)}.")
        self.top_k = top_k
        self._data = data
        self.tokenizer = tokenizer_of(data, run.spec.architecture, light=True)
        self._state = run.state

        @jax.jit
        def probs(state, batch):
            logits = forward(run.graphdef, state.params, batch, task=task, deterministic=True,
                             fp8=state.fp8)
            return jax.nn.softmax(logits, axis=-1)
        self._probs = probs

    def _batches(self, inputs: list, size: int):
        """``(rows of inputs, batch)`` pairs covering every input once, ``size`` rows a batch:
        ``inputs`` are texts, or an array model's inputs (float32 arrays)."""
        batches = input_batches(self._data, inputs, size, self.tokenizer)
        return zip(batches.plan(0), batches.batches(0))

    def __call__(self, inputs: list[str]) -> list:
        """Per input, ``(label, probability, facts)`` or the ``ValueError`` refusing it (an
        array model's file that its dataset cannot make an input of: ``inputs.input_features``;
        ``facts`` says what was read of it, ``{}`` for a text). A batch holds at most
        ``batch_size`` inputs, and no more than there are."""
        inputs = list(inputs)
        made = input_features(self._data, inputs) if self.arrays and inputs else \
            [(t, {}) for t in inputs]
        out = list(made)
        good = [i for i, m in enumerate(made) if not isinstance(m, ValueError)]
        if not good:
            return out
        size = min(self.batch_size, len(good))
        for rows, batch in self._batches([made[i][0] for i in good], size):
            p = np.asarray(self._probs(self._state, batch))
            for r, k in enumerate(rows):
                order = np.argsort(-np.nan_to_num(p[r], nan=-1.0), kind="stable")
                facts = made[good[k]][1]
                if self.top_k:
                    facts = {**facts, "top_k": [prediction_record(None, self.label_names[j],
                                                                  float(p[r, j]), key=None)
                                                for j in order[:self.top_k]]}
                out[good[k]] = (self.label_names[order[0]], float(p[r, order[0]]), facts)
        return out


class Generator:
    """``Generator(run_dir)(texts, max_new_tokens, ...) -> [continuation, ...]``: the run's
    causal LM continues each text (``models.generate.Sampler``: one batch, KV cache; options
    ``temperature``, ``top_k``, ``seed``); generation stops at the tokenizer's end-of-text
    token. Every prompt is checked (length, vocabulary) before anything runs."""

    def __init__(self, run_dir: str):
        # Built as eval and predict build theirs (``checkpoint_run``), on one device; the
        # layers unstacked: decoding with a KV cache runs them one by one.
        run, _ = checkpoint_run(run_dir, ["model.scan_layers=false"], jax.devices()[:1],
                                data=False)
        model, _ = merge(run.graphdef, run.state.params, run.state.fp8)
        if not model.generates:
            raise ValueError(f"run {run_dir!r} trained a {run.spec.task} model, which does "
                             "not generate text; use `jaxaccel predict` or `jaxaccel eval`.")
        self.tokenizer = tokenizer_of(run.resolved.data, run.spec.architecture, light=True)
        self.sampler = Sampler(model, run.cfg.data.pad_multiple)

    def __call__(self, texts: list[str], max_new_tokens: int = 64, **options) -> list[str]:
        prompts = self.tokenizer(list(texts))["input_ids"]
        new = self.sampler(prompts, max_new_tokens, eos_id=self.tokenizer.eos_token_id,
                           **options)
        return [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in new]


def prediction_record(text: str | None, label: str, probability: float,
                      key: str | None = "text") -> dict:
    """One JSON-lines record (the input under ``key``: "text", or "file" for an array run's
    file; None: no input, a ``top_k`` entry); a non-finite probability is ``null`` (valid
    JSON)."""
    record = {} if key is None else {key: text}
    return {**record, "label": label,
            "probability": probability if math.isfinite(probability) else None}
