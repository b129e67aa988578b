"""Rematerialisation policies by name (``model.remat``, ``models.remat``): each keeps for the
backward pass what its name says and computes the same gradients; the config takes the names
and the old true/false; the planner counts what each recomputes, as the compiled step's matmuls
do; ``--fit`` walks the ladder."""
import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from jaxaccel import config, flops
from jaxaccel.models import LLAMA_PRESETS, PRESETS, ModelSpec, build_model, model_spec, remat
from jaxaccel.models.spec import from_config
from jaxaccel.plan import loops
from jaxaccel.plan.compile import abstract_batch
from jaxaccel.train import run as run_lib
from support import TINY_SETS

IDS = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 7 + 3


def _loss_and_params(preset, name, policy="fp32"):
    model = build_model(ModelSpec(preset, remat=name), policy)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        out = nnx.merge(graphdef, p)(IDS)
        return jnp.mean(jnp.square(out.logits if out.logits is not None
                                   else out.last_hidden_state))
    return loss, params


def _kept(preset, name) -> collections.Counter:
    """What the backward pass keeps, by kind: the tags' names and the primitives' outputs
    (``dot_general``, ``device_put``: offloaded), the parameters left out."""
    loss, params = _loss_and_params(preset, name)
    kinds = collections.Counter()
    for _, source in saved_residuals(loss, params):
        if source.startswith("named "):
            kinds[source.split("'")[1]] += 1
        elif source.startswith("output of "):
            kinds[source.split()[2]] += 1
    return kinds


@pytest.mark.parametrize("preset", [LLAMA_PRESETS["llama-tiny"], PRESETS["tiny"]],
                         ids=["llama", "bert"])
def test_each_policy_keeps_what_its_name_says(preset):
    layers = preset.num_hidden_layers
    kept = {name: _kept(preset, name) for name in remat.POLICIES}
    projections = {p: layers for p in remat.ATTENTION_PROJ}
    assert kept["full"]["dot_general"] == 0
    assert kept["minimal"]["dot_general"] >= 6 * layers       # every layer's projections
    assert {k: kept["save_dot_except_mlp"][k] for k in projections} == projections
    assert kept["save_dot_except_mlp"]["dot_general"] == 0
    # The MLP's output is kept where the layer reads it: BERT's post-norm LayerNorm does.
    read = preset is PRESETS["tiny"]
    assert kept["save_dot_except_mlpwi"] == kept["save_dot_except_mlp"] + collections.Counter(
        {"mlpwo": layers if read else 0})
    assert {k: kept["save_qkv_proj"][k] for k in projections} == {
        **projections, "out_proj": 0}
    assert kept["minimal_offloaded"]["device_put"] == kept["minimal"]["dot_general"]
    assert kept["minimal_offloaded"]["dot_general"] == 0
    assert not any(kept["full"][k] for k in projections)
    total = {name: sum(k.values()) for name, k in kept.items()}
    assert [total[name] for name in remat.LADDER] == sorted(
        (total[name] for name in remat.LADDER), reverse=True), total


def _named(kept: collections.Counter) -> dict:
    """The tagged outputs a policy keeps and the matmul outputs it keeps untagged."""
    return {k: n for k, n in kept.items() if k in (*remat.ATTENTION_PROJ, remat.MLP_OUT,
                                                   "dot_general") and n}


def test_save_dot_except_mlpwi_keeps_the_attention_projections_and_the_mlp_output():
    """MaxText's ``save_dot_except_mlpwi`` (its Llama-2 70B v5p recipe's): in BERT's layer,
    which reads the MLP's output after the residual, each layer keeps its four attention
    projections' outputs and its MLP's output projection's (``mlpwo``), no other matmul's;
    the policies beside it on the ladder do not keep that set."""
    layers = PRESETS["tiny"].num_hidden_layers
    want = {name: layers for name in (*remat.ATTENTION_PROJ, remat.MLP_OUT)}
    kept = {name: _named(_kept(PRESETS["tiny"], name))
            for name in ("save_dot_except_mlpwi", "save_dot_except_mlp", "minimal")}
    assert kept["save_dot_except_mlpwi"] == want
    assert kept["save_dot_except_mlp"] != want and kept["minimal"] != want


@pytest.mark.long
def test_every_policy_gives_the_same_gradients():
    want = None
    for name in remat.POLICIES:
        loss, params = _loss_and_params(LLAMA_PRESETS["llama-tiny"], name)
        grads = jax.grad(loss)(params)
        if want is None:
            want = grads
        for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)


def test_the_config_takes_the_names_and_true_and_false():
    spec = lambda *sets: from_config(config.build(sets=list(sets)).model)
    assert spec().remat == "none" and spec("model.remat=false").remat == "none"
    assert spec("model.remat=true").remat == "full"
    assert spec("model.remat=save_qkv_proj").remat == "save_qkv_proj"
    with pytest.raises(ValueError, match="model.remat='most' is not one of"):
        spec("model.remat=most")


def test_the_planner_counts_what_each_policy_recomputes():
    """``full`` recomputes the layers' whole forward (a third of their training FLOPs) but, in
    a pre-norm layer (Llama's), the MLP's output projection, which no policy recomputes there;
    ``save_dot_except_mlp`` the MLP (there: its gate and up projections) and attention's core;
    ``save_dot_except_mlpwi`` the MLP's input projections and the core; ``minimal`` the core
    only."""
    b, s = 4, 2048
    for preset in (LLAMA_PRESETS["llama-1b"], PRESETS["bert-base"]):
        shape = flops.model_shape(ModelSpec(preset))
        got = {name: flops.recompute_flops(shape, b, s, remat.of(name).recomputes)
               for name in remat.POLICIES}
        layers = flops.train_flops(shape, b, s) - 6.0 * shape.head_weights * b * s
        mlp_out = 2.0 * b * s * shape.layers * shape.hidden * shape.intermediate
        mlp_in = mlp_out * (shape.mlp_matrices - 1)
        assert shape.pre_norm == (preset is LLAMA_PRESETS["llama-1b"])
        kept = mlp_out if shape.pre_norm else 0.0      # the projection nothing reads again
        assert got["full"] == pytest.approx(layers / 3 - kept)
        assert got["none"] == 0
        core = flops.attention_flops(shape, b, s) / 3
        assert got["minimal"] == got["minimal_offloaded"] == pytest.approx(core)
        assert got["save_dot_except_mlp"] == pytest.approx(mlp_in + mlp_out - kept + core)
        assert got["save_dot_except_mlpwi"] == pytest.approx(mlp_in + core)
        assert got["minimal"] < got["save_dot_except_mlpwi"] <= got["save_dot_except_mlp"] \
            < got["save_qkv_proj"] < got["full"]


# A tiny model of each family, no dropout (a scanned step's matmuls only).
STEPS = {"llama": ["model.name=llama-tiny", "data.name=canterbury", "model.tokenizer=unused",
                   "data.max_len=16", "train.batch_size=16", "model.attention_dropout=0.0"],
         "bert": TINY_SETS + ["model.hidden_dropout=0.0", "model.attention_dropout=0.0"]}


def _dims(shape: str) -> list[int]:
    return [int(d) for d in re.search(r"\[([\d,]*)\]", shape).group(1).split(",") if d]


def _dot_flops(hlo: str) -> int:
    """The matmul FLOPs of an optimized HLO program: 2 per multiply-add of every ``dot``, times
    the runs of the computation that holds it (``loops.runs``: loop trips counted)."""
    computations, _ = loops.parse(hlo)
    times, total = loops.runs(hlo), 0
    for name, instructions in computations.items():
        for i in instructions.values():
            if i.opcode == "dot":
                lhs = _dims(instructions[i.operands[0]].shape)
                contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", i.attributes)
                total += times[name] * 2 * math.prod(_dims(i.shape)) * math.prod(
                    lhs[int(d)] for d in contracted.group(1).split(","))
    return total


def _step_flops(family: str, name: str, tmp_path) -> tuple[int, float]:
    """(the compiled train step's matmul FLOPs, the planner's ``train_flops +
    recompute_flops``) of ``family``'s tiny model, its layers scanned (as on TPUs and GPUs
    under remat) and rematerialised by policy ``name``, on one CPU device."""
    cfg = config.build(sets=[*STEPS[family], f"workdir={tmp_path}", "train.progress=false",
                             "model.scan_layers=true", f"model.remat={name}"])
    run = run_lib.assemble(run_lib.resolve(cfg, jax.devices("cpu")[:1]), abstract=True,
                           data=False)
    batch = abstract_batch(run, cfg.train.batch_size)
    with jax.set_mesh(run.mesh):
        hlo = run.train_step.lower(run.state, batch).compile().as_text()
    shape, (rows, seq) = flops.model_shape(run.spec), batch["input_ids"].shape
    return _dot_flops(hlo), flops.train_flops(shape, rows, seq) + flops.recompute_flops(
        shape, rows, seq, remat.of(name).recomputes)


@pytest.mark.long
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_the_planner_counts_the_matmuls_the_compiled_step_runs(family, tmp_path):
    """Each policy's compiled train step against the planner's FLOPs, each less its own under
    ``minimal`` (attention's core recomputed: the planner halves a causal core, XLA computes it
    whole; the rest of the model's FLOPs are the same under every policy). In Llama's pre-norm
    layer XLA leaves the MLP's output projection out of the recompute (nothing in the backward
    pass reads its result, ``full`` included); BERT's post-norm LayerNorm reads it."""
    got = {name: _step_flops(family, name, tmp_path) for name in (
        "minimal", "save_dot_except_mlpwi", "save_dot_except_mlp", "save_qkv_proj", "full")}
    compiled, planned = ({name: got[name][k] - got["minimal"][k] for name in got}
                         for k in (0, 1))
    assert compiled == planned
