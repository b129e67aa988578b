"""What more than one test module uses, defined once: the repository's paths and the
``jaxaccel`` command, the tiny in-process run (its ``--set`` strings, its config, its logged
losses, a SIGTERM at its n-th train batch), the environment of a CPU-only subprocess, the tiny
run built on a module's 8 devices, the tiny decoder's run, the float64 Adan rule and its
inputs, packed causal-LM batches, what transformers does with a custom-code folder it is not
trusted to run, your own data through the command (JSONL rows, WAV clips, the tiny classifier
on them), and the skip marks of the compile-only TPU / GPU targets.

Test modules import it as ``support`` (``from support import ...``), as they import
``compile_only``: pytest puts this folder on ``sys.path`` (rootdir-relative "prepend" import
mode; tests/ has no ``__init__.py``), whether it runs from the repository root
(``python -m pytest -n 2 --dist loadfile``) or on one file. No test module imports another.

The 8 devices of ``build`` are those of the ``on_eight_devices`` fixture (conftest.py): a module
that builds with them says ``pytestmark = pytest.mark.usefixtures("on_eight_devices")``."""
from __future__ import annotations

import importlib.util
import itertools
import json
import os
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxaccel import cli, config
from jaxaccel.plan import topology
from jaxaccel.data.packing import pack
from jaxaccel.models import LLAMA_PRESETS
from jaxaccel.train import inference, loop
from jaxaccel.train import run as run_lib
from jaxaccel.train.metrics import read_metrics
from jaxaccel.train.preemption import Preemption
from jaxaccel.train.tasks import TASKS
from kernels_pallas.adan_reference import LANES, make_scalars

# ---- paths and the command ----

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
TINY_CONFIG = os.path.join(CONFIGS, "tiny_synthetic.py")     # the run folder is "tiny_synthetic"
# The ``jaxaccel`` command in a subprocess: [*CLI, "train", "--config", ...].
CLI = (sys.executable, "-m", "jaxaccel.cli")
# How long a test waits for a subprocess: far beyond any real run of the tiny model, however
# loaded the machine, so that only a run that hangs times out (tests wait on events, not on
# time: a step logged, a file written, the process's exit).
LONG_WAIT_S = 1800


def run_cli(capsys, *argv):
    """``jaxaccel *argv`` in this process: (exit code, stdout, stderr)."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def cpu_env(devices=None, **extra):
    """This process's environment for a CPU-only subprocess with ``devices`` fake devices
    (None: one, XLA's default), keeping the other XLA flags and the session's compilation
    cache (conftest): a resumed run and the eval load the steps the first runs compiled."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", **extra)


# ---- the tiny in-process run ----

# The tiny BERT on 64 synthetic examples of 16 tokens: 4 train batches of 16 rows an epoch, eval
# batches of 32 rows.
TINY_SETS = ["model.name=tiny", "data.name=synthetic", "data.synthetic_examples=64",
             "data.synthetic_seq_len=16", "train.batch_size=16", "train.eval_batch_size=32",
             "train.learning_rate=3e-3", "train.progress=false"]
# ... every step logged, no warm-up (the loop's runs: test_train, test_precision).
TINY = TINY_SETS + ["train.log_every=1", "train.warmup_ratio=0.0"]
# ... without dropout (the runs that compare layouts and meshes: ``build``).
TINY_SHARDED = TINY_SETS + [
    "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
    # Adam's m/(sqrt(v)+eps) turns reduction-order rounding in near-zero gradients (a key
    # bias's gradient is mathematically zero; rare embedding rows) into lr-sized steps with
    # eps=1e-8; eps=1e-3 keeps the comparison about sharding, not about rounding.
    "train.eps=1e-3"]
# Multi-tensor Adan through the fused Pallas kernel (interpreted on CPU).
ADAN = ("train.optimizer=adan", "train.optimizer_impl=pallas")


def tiny_cfg(tmp_path, *sets):
    return config.build(sets=TINY + [f"workdir={tmp_path}", *sets])


def logged_losses(run_dir):
    """{step: train loss} of a run folder's metrics."""
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


class _SigtermAt(Preemption):
    """The real stop signal, and a real SIGTERM delivered to this process after step ``n``."""

    def __init__(self, n: int):
        super().__init__()
        self._at, self._seen = n, 0

    def reached(self) -> bool:
        self._seen += 1
        if self._seen == self._at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().reached()


def sigterm_at(n: int) -> loop.Services:
    """The loop's services with a real SIGTERM to this process after its n-th train step."""
    return loop.Services(stop=lambda: _SigtermAt(n))


def resumes_both_ways(tmp_path, sets, one, other, steps):
    """The tiny run of ``sets`` stopped after step 3 with the settings ``one`` and resumed with
    ``other``, and the reverse: each has the losses of the run on ``other`` that never stopped
    (``steps`` of them), its final eval, and the eval of the folder on 2 of ``DEVICES``
    (data parallel on the devices at hand, whatever trained it)."""
    full = loop.train(tiny_cfg(tmp_path, "name=full", *sets, *other))
    lf = logged_losses(full["run_dir"])
    assert sorted(lf) == list(range(1, steps + 1))
    for name, first, second in (("name=from_one", one, other), ("name=from_other", other, one)):
        part = loop.train(tiny_cfg(tmp_path, name, *sets, *first), sigterm_at(3))
        assert part["status"] == "preempted"
        resumed = loop.train(tiny_cfg(tmp_path, name, *sets, *second))
        assert resumed["status"] == "completed"
        lp = logged_losses(part["run_dir"])
        assert sorted(lp) == sorted(lf)
        np.testing.assert_allclose([lp[s] for s in sorted(lf)], [lf[s] for s in sorted(lf)],
                                   rtol=1e-5)
        assert resumed["eval_accuracy"] == pytest.approx(full["eval_accuracy"])
        assert inference.evaluate_run(part["run_dir"], devices=DEVICES[:2])["accuracy"] == \
            pytest.approx(full["eval_accuracy"])


# ---- the tiny run on a module's 8 devices ----

DEVICES = []      # the 8 devices of the running module (set by conftest's ``on_eight_devices``)


def build(tmp_path, mesh, num_devices=8, *sets):
    """The tiny ``TINY_SHARDED`` run on a (data, fsdp, tensor) ``mesh`` of the first
    ``num_devices`` of ``DEVICES``."""
    d, f, t = mesh
    cfg = config.build(sets=TINY_SHARDED + [f"workdir={tmp_path}", f"mesh.data={d}",
                                            f"mesh.fsdp={f}", f"mesh.tensor={t}", *sets])
    return run_lib.build(cfg, DEVICES[:num_devices])


def train_steps(run, k=3, batches=None):
    """``k`` steps of the trainer's own jitted step (``Run.train_step``) on ``run``'s mesh, on
    its first training batches or on ``batches``."""
    state, losses = run.state, []
    batches = run.train_data.batches(0) if batches is None else batches
    with jax.set_mesh(run.mesh):
        for batch in itertools.islice(batches, k):
            state, metrics = run.train_step(state, run.put_batch(batch))
            losses.append(float(metrics["loss"]))
    return losses, state


# ---- the tiny decoder's run, on batches the test hands in ----

# The tiny decoder reading packed documents of 16 tokens (``packed``): no corpus is read, the
# tokenizer is named only so that no corpus BPE is sized.
TINY_LM = ["model.name=llama-tiny", "data.name=canterbury", "model.tokenizer=unused",
           "data.max_len=16", "train.batch_size=16", "train.eval_batch_size=16",
           "train.max_steps=3", "train.learning_rate=3e-3", "train.eps=1e-3",
           "train.progress=false"]


def lm_run(devices, *sets, abstract=False):
    """The tiny decoder's training run (``TINY_LM`` with ``sets``) over ``devices``, as
    ``resolve`` and ``assemble`` build it, without data (its steps take the test's batches);
    ``abstract``: as ``jaxaccel compile`` builds it (shapes, no weights)."""
    resolved = run_lib.resolve(config.build(sets=[*TINY_LM, *sets]), devices)
    return run_lib.assemble(resolved, abstract=True) if abstract else \
        run_lib.assemble(resolved, data=False)


# ---- Adan: the official rule in float64, and its inputs ----

class Float64Adan:
    """The official rule, written out again in float64 numpy, one leaf list at a time."""

    def __init__(self, lr, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, wd=0.0, no_prox=False,
                 max_grad_norm=0.0, decay=None):
        self.__dict__.update(lr=lr, b1=b1, b2=b2, b3=b3, eps=eps, wd=wd, no_prox=no_prox,
                             max_grad_norm=max_grad_norm, decay=decay)
        self.t = 0
        self.state = None

    def step(self, params, grads):
        if self.state is None:
            self.state = [[np.zeros_like(p) for p in params] for _ in range(3)] + [None]
        self.t += 1
        t, b1, b2, b3 = self.t, self.b1, self.b2, self.b3
        lr = self.lr(t - 1) if callable(self.lr) else self.lr
        clip = 1.0
        if self.max_grad_norm > 0:
            norm = np.sqrt(sum(np.sum(g * g) for g in grads))
            clip = min(self.max_grad_norm / (norm + self.eps), 1.0)
        m, v, n, prev = self.state
        gs = [clip * g for g in grads]
        if prev is None or t == 1:
            prev = gs
        out = []
        for i, (p, g) in enumerate(zip(params, gs)):
            d = g - prev[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * d
            n[i] = b3 * n[i] + (1 - b3) * (g + b2 * d) ** 2
            den = np.sqrt(n[i]) / np.sqrt(1 - b3 ** t) + self.eps
            step = lr / (1 - b1 ** t) * m[i] / den + lr * b2 / (1 - b2 ** t) * v[i] / den
            wd = self.wd if (self.decay is None or self.decay[i]) else 0.0
            if self.no_prox:
                out.append(p * (1 - lr * wd) - step)
            else:
                out.append((p - step) / (1 + lr * wd))
        self.state = [m, v, n, gs]
        return out

    def restart(self):
        self.t = 0
        self.state = [[np.zeros_like(x) for x in self.state[0]] for _ in range(3)] + \
            [self.state[3]]


# The hyper-parameters the float64 comparisons run (``lr`` defaults to the test's).
CASES = {
    "prox": dict(wd=0.05),
    "no_prox": dict(wd=0.05, no_prox=True),
    "clipped": dict(wd=0.02, max_grad_norm=1.0),
    "schedule": dict(wd=0.0, lr=optax.linear_schedule(1e-2, 1e-3, 60)),
}


def small_tree(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"w": (7, 13), "bias": (13,), "deep": {"k": (3, 5, 2), "scale": (5,)}}
    return jax.tree_util.tree_map(lambda s: rng.normal(size=s).astype(np.float32), shapes,
                                  is_leaf=lambda x: isinstance(x, tuple))


def bert_tree(hidden=64, layers=2, vocab=1000, mlp=96, labels=3):
    """BERT-shaped parameters (odd sizes), the structure the trainer hands the optimizer."""
    rng = np.random.default_rng(1)
    n = lambda *s: rng.normal(size=s).astype(np.float32) * 0.1
    ln = lambda: {"scale": 1 + n(hidden), "bias": n(hidden)}
    lin = lambda a, b: {"kernel": n(a, b), "bias": n(b)}
    layer = lambda: {"attention": {"query": lin(hidden, hidden), "key": lin(hidden, hidden),
                                   "value": lin(hidden, hidden), "output": lin(hidden, hidden),
                                   "layer_norm": ln()},
                     "intermediate": lin(hidden, mlp), "output": lin(mlp, hidden),
                     "layer_norm": ln()}
    return {"embeddings": {"word_embeddings": {"embedding": n(vocab, hidden)},
                           "position_embeddings": {"embedding": n(128, hidden)},
                           "layer_norm": ln()},
            "layers": {i: layer() for i in range(layers)},
            "pooler": lin(hidden, hidden), "classifier": lin(hidden, labels)}


def grads_at(step, params):
    leaves, treedef = jax.tree_util.tree_flatten(params)
    rng = np.random.default_rng(100 + step)
    return treedef.unflatten([rng.normal(size=x.shape).astype(np.float32) for x in leaves])


def rel(a, b):
    """The relative L2 distance of two trees of arrays (``b`` the reference), in float64."""
    a, b = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(a)]), \
        np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(b)])
    return np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b)


def flat_args(rows, dtype=jnp.float32):
    """Arguments of the flat Adan update kernel (``kernels_pallas.adan``), in its order
    (s, g, m, v, n, prev, p): random ``rows`` x LANES buffers, weight decay and clipping on."""
    k = jax.random.split(jax.random.PRNGKey(0), 6)
    g, m, v, prev, p = [jax.random.normal(kk, (rows, LANES), dtype) for kk in k[:5]]
    n = jnp.abs(jax.random.normal(k[5], (rows, LANES)))
    s = make_scalars(lr=1e-3, b1=0.98, b2=0.92, b3=0.99, eps=1e-8, weight_decay=0.02,
                     count=3, clip=0.7)
    return s, g, m, v, n, prev, p


# ---- causal-LM batches of the tiny decoder ----

LM = TASKS["causal_lm"]


def packed(rows, length):
    """A causal-LM batch of rows of documents (lists of token ids), each row's documents
    packed by ``data.packing.pack`` into one row of ``length`` tokens."""
    for docs_ in rows:
        assert sum(map(len, docs_)) <= length, "each row's documents must fit in one row"
    rows = [pack([np.asarray(d, np.int32) for d in docs_], length) for docs_ in rows]
    return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}


def docs(seed, *lengths, vocab=LLAMA_PRESETS["llama-tiny"].vocab_size):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in lengths]


def logits(model, batch, **kw):
    return np.asarray(model(batch["input_ids"], positions=batch["positions"],
                            segment_ids=batch["segment_ids"], **kw).logits)


def lm_loss(model, batch) -> float:
    """The weighted next-token cross entropy of ``batch``, from the log-softmax by hand."""
    logp = np.asarray(jax.nn.log_softmax(logits(model, batch), -1))
    picked = np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    w = batch["target_weights"]
    return float(-(picked * w).sum() / w.sum())


# ---- Hugging Face exports ----

def assert_custom_code_not_loaded_silently(folder, auto_class: str, plain_class: str):
    """A folder written with ``custom_code=True`` (``models.remote_code``) is refused by
    transformers' ``auto_class`` without ``trust_remote_code``, and transformers' own
    ``plain_class`` built from it directly reports its head missing and the folder's
    ``mean_pooling_classifier`` unexpected, rather than loading a CLS-pooling model silently."""
    import transformers
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        getattr(transformers, auto_class).from_pretrained(folder, trust_remote_code=False)
    _, info = getattr(transformers, plain_class).from_pretrained(folder,
                                                                 output_loading_info=True)
    assert info["missing_keys"] == {"classifier.weight", "classifier.bias"}
    assert info["unexpected_keys"] == {"mean_pooling_classifier.weight",
                                       "mean_pooling_classifier.bias"}


# ---- your own data through the command (the fifth fault probe, issue 57) ----

def write_rows(path, n=30, text="text", label="label"):
    """``n`` JSONL records of two classes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({text: f"row {i} of the folder", label: "ab"[i % 2]})
                            + "\n" for i in range(n)))
    return path


def own_data_sets(tmp_path, *extra):
    """The tiny classifier on ``data.name=files`` (its cache and runs in ``tmp_path``)."""
    return [f"workdir={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}", "model.name=tiny",
            "data.name=files", "train.batch_size=8", "train.eval_batch_size=8",
            "train.max_steps=2", "train.progress=false", "train.learning_rate=1e-3", *extra]


def cli_sets(capsys, command, *argv_sets):
    """``jaxaccel <command> --set ...``: (exit status, stdout, stderr)."""
    return run_cli(capsys, *command.split(), *(f"--set={s}" for s in argv_sets))


def write_wav(path, freq, rate=8000):
    """A 0.3 s sine of ``freq`` Hz, 16-bit PCM."""
    from scipy.io import wavfile
    t = np.arange(int(0.3 * rate)) / rate
    path.parent.mkdir(parents=True, exist_ok=True)
    wavfile.write(path, rate, (0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16))


# ---- compile-only targets ----

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed (pip install 'jaxaccel[aot]')")
needs_cuda_plugin = pytest.mark.skipif(
    not topology.cuda_plugin_installed() or jax.config.jax_platforms != "cpu",
    reason="compile-only CUDA devices need the CUDA plugin (pip install 'jaxaccel[aot]') and "
           "JAX_PLATFORMS=cpu")
