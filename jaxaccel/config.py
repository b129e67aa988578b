"""Configuration: one commented base holding every knob, thin Python config files, key=value overrides.

A config file (``configs/NAME.py``, or just ``NAME`` for one there) defines ``get_config()``
returning a dict of overrides of ``BASE``, nested (``{"train": {"epochs": 3}}``) or dotted
(``{"train.epochs": 3}``); its docstring says how to run it and what it reaches. A ``.json``
file holding such a dict is a config file too (a run folder's ``config.json`` is one). On the
command line, ``--set key=value`` overrides anything (values parsed as Python literals, else
taken as strings). Unknown keys fail loudly and list close matches; values are type-checked
against the base, and values are checked against the rules no run can break
(``config_checks.validate``).
"""
from __future__ import annotations

import ast
import contextlib
import contextvars
import copy
import difflib
import importlib.util
import json
import os
import sys
from typing import Any

from jaxaccel.config_checks import validate


BASE: dict[str, Any] = {
    "name": "run",                  # run name: outputs go to {workdir}/{name}
    "workdir": "runs",              # root folder for checkpoints, metrics, TensorBoard events:
                                    # local, or a bucket (gs://BUCKET/runs, s3://...: the gcs /
                                    # s3 extra; docs/guides/buckets-and-pods.md)
    "seed": 0,                      # parameter init, dropout and data order
    "compilation_cache": "auto",    # jaxaccel CLI: JAX's persistent compilation cache, so a
                                    # second run recompiles nothing. auto: an already set
                                    # $JAX_COMPILATION_CACHE_DIR, else $XDG_CACHE_HOME/jaxaccel/
                                    # jax (~/.cache/jaxaccel/jax); a folder; or "off"
    "model": {
        "name": "minilm-l6",        # preset: minilm-l6, bert-base, bert-large, tiny (BERT:
                                    # classification); llama-tiny, llama-cpu, llama-125m,
                                    # llama-350m, llama-1b, llama3-8b, llama2-70b (decoders:
                                    # causal LM); vit-tiny,
                                    # vit-audio-cpu, vit-b16-mae, audiomae-b16 (ViT: MAE,
                                    # classification); models/spec.py
        "checkpoint": "",           # HF checkpoint dir (local or gs://, s3://); "" = the
                                    # packaged MiniLM for minilm-l6,
                                    # random init for the other presets
        "init_from": "",            # a run folder: start from its newest checkpoint's weights
                                    # where paths and shapes agree (e.g. an MAE run's encoder
                                    # for classification); its head is new
        "tokenizer": "",            # tokenizer dir; "" = the checkpoint's (or the packaged
                                    # MiniLM's uncased BERT vocab for random-init presets; a
                                    # corpus's own BPE, data.tokenizer_vocab, for its LM run)
        "task": "",                 # "" = the family's first: classification (BERT), causal_lm
                                    # (Llama), mae (ViT: masked-autoencoder pretraining; or
                                    # classification)
        "num_labels": 2,            # classification models only
        "attention_impl": "xla",    # auto | xla | pallas | cudnn | mosaic_gpu
                                    # (kernels_pallas/attention.py)
        "pooling": "cls",           # what the classifier reads: cls (BERT pooler) | mean
                                    # (masked mean of the last hidden states)
        "hidden_dropout": None,     # None = the checkpoint's value
        "attention_dropout": None,  # None = the checkpoint's value
        "remat": None,              # what each layer keeps for the backward pass (the rest
                                    # is computed again): none (None, false) | full (true) |
                                    # minimal | save_dot_except_mlpwi |
                                    # save_dot_except_mlp | save_qkv_proj |
                                    # minimal_offloaded (models/remat.py)
        "scan_layers": None,        # the layers' parameters stacked [layers, ...] and run by
                                    # one jax.lax.scan: one compiled layer body (a pipeline
                                    # stacks them by stage instead); models/stack.py. None:
                                    # on TPUs and GPUs where model.remat is set, not on the
                                    # CPU (slower steps there) nor without remat (every
                                    # residual kept, stacked: more memory and HBM traffic)
        "pipeline_repeats": 1,      # pipeline: layer groups per stage (R); R > 1 is the
                                    # circular (interleaved) schedule, a smaller bubble
    },
    "data": {
        "name": "rt_snippets",      # the source (data/sources.py): rt_snippets | imdb_reviews
                                    # (labelled texts); canterbury (a corpus: packed causal-LM
                                    # rows); bfsong (birdsong spectrograms: ViT mae,
                                    # classification); synthetic; your data: files | tfds | hf
                                    # | audio (docs/guides/your-data.md); mixture (data.mixture)
        "mixture": [],              # data.name=mixture: the sources mixed (corpora, or
                                    # labelled texts), each a dict of the data keys it sets
                                    # (the rest as this section has them; max_len and
                                    # tokenizer_vocab are the mixture's) and its "weight" > 0,
                                    # its share of the training rows, e.g.
                                    # [{"name": "canterbury", "weight": 3}, {"name": "files",
                                    # "train_files": "notes/*.txt", "weight": 1}]; an epoch
                                    # ends when the first source runs out (data/mixing.py)
        "data_dir": "",             # TFDS data dir ("" = TFDS default / $TFDS_DATA_DIR)
        "manual_dir": "",           # where manually downloaded archives are (imdb_reviews)
        "train_files": "",          # files, audio: glob(s) of the training files, comma-
                                    # separated; a folder: every file under it; images: a
                                    # folder of class folders, or a .csv/.jsonl listing; local
                                    # or in a bucket (gs://, s3://: copied to the host once)
        "eval_files": "",           # files, audio, images: the eval split's files ("" = hold out
                                    # data.holdout of the training split)
        "holdout": 0.0,             # > 0: this fraction of the training split is the eval
                                    # split where the source has none (fixed rows)
        "dataset": "",              # tfds: the dataset's name in data_dir (imdb_reviews,
                                    # name:1.0.0); hf: the folder save_to_disk wrote
        "format": "auto",           # files: auto (by extension) | jsonl | csv | tsv | parquet |
                                    # arrow | text
        "text_field": "text",       # files, tfds, hf: the field holding the text
        "label_field": "label",     # files, tfds, hf, images' listing: the label's field (class
                                    # names or integers); a corpus reads none
        "documents": "file",        # files, plain text: file (one document a file; a label
                                    # is its folder's name) | paragraph (blank-line separated)
        "sample_rate": 16000,       # audio: clips are resampled to this rate (Hz)
        "cache_dir": "",            # token caches ("" = $JAXACCEL_DATA_CACHE, else
                                    # ~/.cache/jaxaccel/data); jaxaccel data prepare fills it
        "workers": 0,               # processes that tokenize a cache (0 = one a CPU)
        "train_examples": 0,        # > 0: examples an epoch trains on, for planning a run on
                                    # data not yet read (jaxaccel compile)
        "train_tokens": 0,          # > 0: a corpus's training tokens, for planning likewise
        "max_len": 128,             # truncate longer sequences (clamped to the model's maximum);
                                    # a corpus: the packed row length (<= the model's maximum)
        "pad_multiple": 16,         # pad each batch to its longest row, rounded up to this
        "bucket": True,             # group similar lengths into batches (less padding)
        "eval_split": "test",       # test | validation (needs validation_size > 0); a corpus
                                    # (canterbury): validation; tfds, hf: a split's name
        "validation_size": 0,       # > 0: hold these many training examples out as the
                                    # "validation" split (fixed rows, data/splits.py)
        "tokenizer_vocab": 8192,    # corpus without model.tokenizer/checkpoint: tokens of the
                                    # byte-level BPE trained on its train split (data/bpe.py)
        "synthetic_examples": 4096, # synthetic only: examples per split
        "synthetic_seq_len": 128,   # synthetic only
        "synthetic_min_len": 0,     # synthetic only: > 0 gives rows of lengths uniform in
                                    # [min_len, seq_len] (padded batches); 0: all seq_len
    },
    "train": {
        "epochs": 1,
        "max_steps": 0,             # > 0: stop after this many steps (overrides epochs)
        "batch_size": 32,           # global batch, summed over all devices and processes
        "eval_batch_size": 128,
        "optimizer": "adamw",       # adamw | adan
        "learning_rate": 1e-4,
        "schedule": "linear",       # linear | cosine | constant (after warm-up)
        "warmup_ratio": 0.1,        # fraction of the steps spent warming up linearly from 0
        "weight_decay": 0.01,       # not applied to biases and LayerNorm parameters
        "max_grad_norm": 1.0,       # global-norm clipping; 0 disables
        "layer_decay": 1.0,         # layer-wise lr decay in (0, 1]: of L layers, layer i
                                    # (0-based) steps at lr * decay**(L - i), the embeddings
                                    # at decay**(L + 1), the head at lr; 1 = off
        "b1": None,                 # None = the optimizer's default (adamw 0.9, adan 0.98)
        "b2": None,                 # adamw 0.999, adan 0.92
        "b3": None,                 # adan only: 0.99
        "eps": None,                # adamw 1e-8, adan 1e-8
        "optimizer_impl": "auto",   # adan only: auto | xla | pallas | mosaic_gpu | per_leaf
                                    # (optim/adan.py)
        "flat_params": False,       # adan only: parameters and state live in flat buffers,
                                    # one fused pass per step (the flat layout,
                                    # jaxaccel/train/layout.py); optimizer_impl then picks the
                                    # kernel: auto|xla|pallas|mosaic_gpu
        "grad_accum": 1,            # micro-batches per optimizer step
        "loss_chunks": 0,           # causal LM: > 1 takes the loss over this many sequence
                                    # chunks, never the whole [batch, length, vocab] float32
                                    # logits at once (train/tasks.py); must divide the length.
                                    # 1: the whole logits; 0: chunks where, with remat, the
                                    # logits would be the step's peak (tasks.auto_loss_chunks)
        "microbatches": 0,          # pipeline (mesh.stage > 1): micro-batches per pass through
                                    # the stages, >= mesh.stage; 0 = mesh.stage. The bubble
                                    # is (S-1)/(R*M+S-1)
        "unpad": True,              # classification: the per-token layers skip padding
                                    # (models/unpad.py); steps without grad_accum only
        "log_every": 10,            # steps between metric records
        "checkpoint_every": 0,      # steps between checkpoints; 0 = epoch ends and the end only
        "keep_checkpoints": 2,      # >= 1 newest checkpoints kept
        "resume": True,             # continue from the latest checkpoint in the run folder
                                    # (refused if model/optimizer/data keys changed)
        "overwrite": False,         # delete the run folder's checkpoints, metrics and config
                                    # first and start afresh (resume=False on a used folder
                                    # is refused otherwise: runs are never mixed)
        "eval_every_epoch": True,
        "progress": True,           # progress bar on stderr
    },
    "precision": {
        "policy": "fp32",           # fp32 | bf16 | fp16 (dynamic loss scaling) | fp8 (encoder
                                    # matmuls E4M3/E5M2, delayed scaling); jaxaccel/precision.py
        "loss_scale_init": 32768.0, # fp16: initial loss scale (2**15)
        "loss_scale_growth_interval": 2000,  # fp16: finite steps in a row before the scale x2
        "max_consecutive_skips": 25,  # fp16: stop the run after this many skipped steps in a
                                    # row (non-finite gradients at every scale tried)
        "fp8_amax_history": 1024,   # fp8: steps of amax history per scale (Transformer Engine)
        "fp8_layers": "paying",     # fp8: paying (the block Dense layers whose GEMMs are large
                                    # enough to be faster in fp8 on the run's device; every
                                    # one where it has no fp8 peak: CPU, TPU) | all
        "logits_dtype": "float32",  # causal LM: float32 | bfloat16, the dtype the head's matmul
                                    # writes the logits (and their gradient) in; the loss is
                                    # float32 either way (bfloat16: MaxText's default)
    },
    "mesh": {                       # device mesh; -1 fills the remaining devices
        "data": -1,                 # pure data parallel: batch split, params replicated
        "fsdp": 1,                  # FSDP / ZeRO-3: params, grads, optimizer state split
        "tensor": 1,                # Megatron tensor parallel: heads and MLP hidden split
        "stage": 1,                 # pipeline stages: the layers split into groups, run on
                                    # micro-batches (train/pipeline.py); 1 = no pipeline
        "dcn_data": 1,              # several TPU slices: of mesh.data's ways, those between
                                    # slices over the data-center network (DCN), the rest
                                    # within a slice (MaxText's dcn_data_parallelism); must
                                    # divide mesh.data
        "dcn_fsdp": 1,              # the same for mesh.fsdp; dcn_data x dcn_fsdp = the slices
    },
    "sharding": {
        "zero1": False,             # ZeRO-1: also split the optimizer state over the batch
                                    # axes (data x fsdp) while params stay as the rules say
        "pipeline_gather_once": False,  # mesh.stage > 1 with mesh.fsdp > 1: gather each stage's
                                    # layers over fsdp once per step instead of at every
                                    # schedule step (each use's gradient reduce-scattered);
                                    # costs the stage's whole weights in memory
    },
}


class Config(dict):
    """A nested dict with attribute access (``cfg.train.epochs``)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def to_dict(self) -> dict:
        return {k: v.to_dict() if isinstance(v, Config) else v for k, v in self.items()}


def _wrap(d: dict) -> Config:
    return Config({k: _wrap(v) if isinstance(v, dict) else v for k, v in d.items()})


def _all_keys(d: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + k)
        if isinstance(v, dict):
            out += _all_keys(v, prefix + k + ".")
    return out


def _check_type(key: str, old: Any, new: Any) -> Any:
    if isinstance(old, dict):
        example = next(iter(old), "KEY")
        raise ValueError(f"config key {key!r} is a section, not a value (got {new!r}); set "
                         f"its keys instead, e.g. {key}.{example}=...")
    if old is None:
        return new
    if new is None:
        raise ValueError(f"config key {key!r} cannot be None/null (default {old!r}); give a "
                         f"{type(old).__name__}.")
    if isinstance(old, bool):
        if not isinstance(new, bool):
            raise ValueError(f"config key {key!r} expects true/false (True/False), got {new!r}.")
        return new
    if isinstance(old, float) and isinstance(new, int) and not isinstance(new, bool):
        return float(new)
    if isinstance(old, float) and isinstance(new, str) and new.strip().lower().lstrip("+-") in \
            ("nan", "inf", "infinity"):
        raise ValueError(f"config key {key!r} expects a finite number (default {old!r}), got "
                         f"{new}.")
    if type(new) is not type(old):
        raise ValueError(f"config key {key!r} expects a {type(old).__name__} (default "
                         f"{old!r}), got {new!r} of type {type(new).__name__}.")
    return new


def set_key(cfg: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested dict, failing loudly on unknown keys."""
    node, parts = cfg, dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            known = _all_keys(cfg)
            close = difflib.get_close_matches(dotted, known, n=3, cutoff=0.6)
            hint = f" Close matches: {', '.join(close)}." if close else ""
            raise KeyError(f"unknown config key {dotted!r}.{hint}")
        if i == len(parts) - 1:
            if isinstance(node[part], dict) and isinstance(value, dict) and value:
                for k, v in value.items():
                    set_key(cfg, f"{dotted}.{k}", v)
            else:
                node[part] = _check_type(dotted, node[part], value)
        else:
            node = node[part]


def _check_mixture_keys(cfg: Config) -> None:
    """Each source of ``data.mixture`` (dicts with a weight: ``config_checks``) sets keys of
    the ``data`` section, each value of the type the section has and within its rules."""
    for i, part in enumerate(cfg["data"]["mixture"]):
        source = {**cfg, "data": {**cfg["data"], "mixture": []}}
        try:
            for key, value in part.items():
                if key != "weight":
                    set_key(source, f"data.{key}", value)
            validate(_wrap(source))
        except (KeyError, ValueError) as e:
            raise type(e)(f"data.mixture[{i}]: {e.args[0]}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key=value``; the value is a Python literal if it parses as one, else a string."""
    if "=" not in text:
        raise ValueError(f"override {text!r} is not of the form key=value.")
    key, raw = text.split("=", 1)
    lowered = {"true": True, "false": False, "none": None, "null": None}
    if raw.lower() in lowered:
        return key.strip(), lowered[raw.lower()]
    try:
        return key.strip(), ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key.strip(), raw


@contextlib.contextmanager
def _importable_folder(folder: str):
    """Put a config file's folder first on ``sys.path`` while the file runs, so configs import
    each other plainly (``import bert_base_imdb``), big_vision style, from any working
    directory. Modules imported from that folder are dropped afterwards: the next load reads
    the files again, and a same-named file in another folder is never shadowed."""
    before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)
        for name in set(sys.modules) - before:
            file = getattr(sys.modules[name], "__file__", None)
            if file and os.path.abspath(file).startswith(folder + os.sep):
                del sys.modules[name]


def resolve(path: str) -> str:
    """The config file ``path`` names: the path itself, or for the bare name of a known config
    (``minilm_rt``) ``configs/minilm_rt.py``; ``FileNotFoundError`` listing them otherwise."""
    if os.path.isfile(path):
        return path
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs")
    known = sorted(f[:-3] for f in os.listdir(here) if f.endswith(".py")) \
        if os.path.isdir(here) else []
    if path in known:
        return os.path.join(here, path + ".py")
    raise FileNotFoundError(f"config file {path!r} not found. Pass a file's path, or the name "
                            f"of one in {here}: {known}")


def _load_json(path: str) -> dict:
    """A JSON config file: the same overrides a ``get_config()`` returns (a run folder's
    ``config.json`` is one)."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"config file {path!r} is not valid JSON: {e.msg} at line "
                             f"{e.lineno} column {e.colno}. Fix the file.") from None


def _load_python(path: str) -> dict:
    spec = importlib.util.spec_from_file_location(f"jaxaccel_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    with _importable_folder(os.path.dirname(path)):
        try:
            spec.loader.exec_module(module)
        except SyntaxError as e:
            raise ValueError(f"config file {path!r} has a syntax error at line {e.lineno}: "
                             f"{e.msg}: {(e.text or '').strip()!r}. Fix the file.") from None
        except Exception as e:
            raise ValueError(f"config file {path!r} failed to run: {type(e).__name__}: {e}. "
                             "Fix the file.") from None
        if not callable(getattr(module, "get_config", None)):
            raise ValueError(f"config file {path!r} defines no get_config() function.")
        try:
            return module.get_config()
        except Exception as e:
            raise ValueError(f"config file {path!r}: get_config() raised {type(e).__name__}: "
                             f"{e}. Fix the file.") from None


def load_file(path: str) -> dict:
    """The overrides a config file gives: a Python file's ``get_config()``, or a JSON file's
    object. ``path`` may be the bare name of a config in ``configs/`` (``resolve``).

    A Python file's folder is importable while it runs: ``configs/bert_base_imdb_adan.py``
    starts from ``import bert_base_imdb``.
    """
    path = os.path.abspath(resolve(path))
    overrides = _load_json(path) if path.endswith(".json") else _load_python(path)
    what = "its JSON" if path.endswith(".json") else "get_config()"
    if not isinstance(overrides, dict):
        raise ValueError(f"config file {path!r}: {what} gave {overrides!r}; expected a dict of "
                         "overrides, e.g. {'train.epochs': 3}.")
    bad = [k for k in overrides if not isinstance(k, str)]
    if bad:
        raise ValueError(f"config file {path!r}: {what} gave the key(s) {bad}, which are not "
                         "config key names; use strings such as 'train.epochs' (or nested "
                         "{'train': {'epochs': 3}}).")
    return overrides


def build(overrides: dict | None = None, sets: list[str] | None = None) -> Config:
    """BASE, then a config file's overrides, then ``key=value`` strings; validated."""
    cfg = copy.deepcopy(BASE)
    for key, value in (overrides or {}).items():
        set_key(cfg, key, value)
    for text in sets or []:
        set_key(cfg, *parse_override(text))
    cfg = _wrap(cfg)
    validate(cfg)
    _check_mixture_keys(cfg)
    return cfg


_DEVICE_COUNT = contextvars.ContextVar("jaxaccel_config_device_count", default=None)


def device_count() -> int:
    """The number of devices the config is loaded for: config files size global batches with
    it (``"train.batch_size": 16 * device_count()``). ``jax.device_count()``, except while
    ``load(..., device_count=n)`` loads a config for a planned target (``jaxaccel compile``)."""
    n = _DEVICE_COUNT.get()
    if n is None:
        import jax
        return jax.device_count()
    return n


def load(path: str | None, sets: list[str] | None = None, *,
         device_count: int | None = None) -> Config:
    """The config of the file ``path`` (None: the base alone) with ``sets`` applied.
    ``device_count``: the devices the run is for, when not this machine's (what the file's
    ``device_count()`` answers while it runs)."""
    token = _DEVICE_COUNT.set(device_count)
    try:
        return build(load_file(path) if path else None, sets)
    finally:
        _DEVICE_COUNT.reset(token)
