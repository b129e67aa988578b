"""Scanned layers (``model.scan_layers``): the layers' parameters stacked [L, ...] in the train
state (``forms.stacked.Stacked`` with ``models.stack.Scan``) and run by one ``jax.lax.scan``.
The scanned step is the unscanned step (losses, parameters, fp8 state) for every family and
with what composes with it (remat, gradient accumulation, fp8, layer decay, the flat layout,
FSDP); its program holds one layer body whatever the depth; checkpoints move between scanned
and unscanned runs both ways."""
import dataclasses
import itertools

import jax
import numpy as np
import pytest

from jaxaccel import config, forms
from jaxaccel.forms.stacked import Stacked
from jaxaccel.models import model_spec
from jaxaccel.models.stack import Scan
from jaxaccel.train import pipeline
from jaxaccel.train import run as run_lib
from support import DEVICES, TINY_SETS, docs, needs_libtpu, packed, resumes_both_ways

pytestmark = pytest.mark.usefixtures("on_eight_devices")   # DEVICES: the module's 8 devices

# The tiny model of each family, dropout on where the family has it (test_pipeline's and
# test_vit's settings); the decoder reads packed documents (no corpus, a tokenizer named).
FAMILIES = {
    "bert": TINY_SETS + ["model.hidden_dropout=0.1", "model.attention_dropout=0.1",
                         "train.eps=1e-3"],
    "llama": ["model.name=llama-tiny", "data.name=canterbury", "model.tokenizer=unused",
              "data.max_len=16", "train.batch_size=16", "train.eval_batch_size=16",
              "train.max_steps=3", "train.learning_rate=3e-3", "train.eps=1e-3",
              "model.attention_dropout=0.1", "train.progress=false"],
    "vit": ["model.name=vit-tiny", "data.name=synthetic", "data.synthetic_examples=64",
            "train.batch_size=16", "train.eval_batch_size=32", "train.warmup_ratio=0.0",
            "train.learning_rate=3e-3", "train.progress=false", "train.eps=1e-3"],
}
LM_BATCHES = [packed([docs(8 * i + r, 5, 9, 2) for r in range(16)], 16) for i in range(2)]
MESH = ["mesh.data=2", "mesh.fsdp=2"]


def _run(family, tmp_path, *sets, layers=None, abstract=False):
    cfg = config.build(sets=[*FAMILIES[family], f"workdir={tmp_path}", *sets])
    spec = model_spec(cfg.model)
    if layers is not None:
        spec = dataclasses.replace(spec, architecture=dataclasses.replace(
            spec.architecture, num_hidden_layers=layers))
    r = run_lib.resolve(cfg, DEVICES[:4], spec=spec)
    return run_lib.assemble(r, abstract=abstract, data=family != "llama" and not abstract)


def two_steps(family, tmp_path, *sets):
    """(losses, per-layer parameters, fp8 state, run, state) after two train steps."""
    run = _run(family, tmp_path, *MESH, *sets)
    batches = LM_BATCHES if family == "llama" else \
        itertools.islice(run.train_data.batches(0), 2)
    state, losses = run.state, []
    with jax.set_mesh(run.mesh):
        for batch in batches:
            state, metrics = run.train_step(state, run.put_batch(batch))
            losses.append(float(metrics["loss"]))
    return (losses, jax.device_get(forms.portable(state.params)), jax.device_get(state.fp8),
            run, state)


def _close(a, b, atol):
    leaves = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    assert max(float(np.max(np.abs(x - y))) for x, y in leaves) < atol


# Each family by default; what scanning composes with (remat, accumulation, fp8, layer decay,
# the flat Adan layout) under -m slow (20-35 s each on the 2-core CPU: the suite's time).
CASES = [("bert", ()), ("llama", ()), ("vit", ())] + [pytest.param(*case, marks=pytest.mark.slow)
                                                     for case in [
    ("llama", ("model.remat=true",)),
    ("bert", ("model.remat=save_dot_except_mlp",)),
    ("llama", ("train.grad_accum=2",)),
    ("bert", ("precision.policy=fp8",)),
    ("bert", ("train.layer_decay=0.8",)),
    ("vit", ("train.optimizer=adan", "train.optimizer_impl=xla", "train.flat_params=true"))]]


@pytest.mark.parametrize("family,extra", CASES)
@pytest.mark.long
def test_scanned_steps_equal_the_unscanned_steps(tmp_path, family, extra):
    plain = two_steps(family, tmp_path, "model.scan_layers=false", *extra)
    scanned = two_steps(family, tmp_path, "model.scan_layers=true", *extra)
    params = scanned[4].params
    stacked = params.view() if hasattr(params, "view") else params
    layers = scanned[3].spec.architecture.num_hidden_layers
    assert isinstance(stacked, Stacked) and stacked.stacking == Scan(layers)
    assert {x.shape[0] for x in jax.tree_util.tree_leaves(stacked.layers)} == {layers}
    np.testing.assert_allclose(scanned[0], plain[0], rtol=1e-5)
    _close(scanned[1], plain[1], 1e-5)
    if "precision.policy=fp8" in extra:
        _close(scanned[2], plain[2], 1e-6)


def _dots(run) -> int:
    rows, length = run.cfg.train.batch_size, run.cfg.data.max_len
    text = run.train_step.lower(run.state, run.abstract_batch(rows, length)).as_text()
    return text.count("dot_general")


def test_the_scanned_step_holds_one_layer_body(tmp_path):
    """The lowered scanned step has as many matmuls for 4 decoder layers as for 2 (one body,
    run by the loop); unscanned, each layer adds its own."""
    dots = {(scan, n): _dots(_run("llama", tmp_path, f"model.scan_layers={scan}", layers=n,
                                  abstract=True))
            for scan in ("true", "false") for n in (2, 4)}
    assert dots["true", 2] == dots["true", 4], dots
    assert dots["false", 4] > dots["false", 2] > 0, dots


@needs_libtpu
def test_layers_are_scanned_by_default_on_tpus_with_remat_not_on_the_cpu(tmp_path,
                                                                          compile_target):
    """Without remat a scan keeps every residual of its body, stacked (models.stack.Scan.of):
    by default rematerialised layers are scanned on a TPU, layers without remat are not, and
    nothing is on the CPU; an explicit setting is taken as it is."""
    tpu = compile_target("v5e:2x2").devices

    def stacking(*sets, devices):
        cfg = config.build(sets=[*FAMILIES["llama"], f"workdir={tmp_path}", *sets])
        return run_lib.resolve(cfg, devices).stacking

    scan = Scan(model_spec(config.build(sets=FAMILIES["llama"]).model)
                .architecture.num_hidden_layers)
    assert stacking("model.remat=full", devices=tpu) == scan
    assert stacking("model.remat=minimal", devices=tpu) == scan
    assert stacking(devices=tpu) is None
    assert stacking("model.remat=full", devices=DEVICES) is None
    assert stacking("model.scan_layers=true", devices=tpu) == scan
    assert stacking("model.scan_layers=false", "model.remat=full", devices=tpu) is None


def test_a_pipeline_stacks_its_layers_by_stage_whatever_scan_layers_says(tmp_path):
    cfg = config.build(sets=[*FAMILIES["llama"], f"workdir={tmp_path}", "mesh.stage=2",
                             "mesh.data=4", "model.scan_layers=true"])
    r = run_lib.resolve(cfg, DEVICES)
    assert isinstance(r.stacking, pipeline.Stages) and r.stacking is r.stages


@pytest.mark.long
def test_checkpoints_move_between_scanned_and_unscanned_runs(tmp_path):
    """Runs stopped after step 3 scanned (or not), resumed the other way, both ways: the
    losses of the unscanned run that never stopped (dropout on), its final eval, and the eval
    of the folder. Multi-tensor Adan: its moments are packed over the stacked layers, so the
    checkpoint converts through both forms."""
    sets = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.max_steps=6",
            "mesh.data=-1", "train.optimizer=adan", "train.optimizer_impl=xla"]
    resumes_both_ways(tmp_path, sets, ("model.scan_layers=true",),
                      ("model.scan_layers=false",), 6)
