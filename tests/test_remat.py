"""Rematerialisation policies by name (``model.remat``, ``models.remat``): each keeps for the
backward pass what its name says and computes the same gradients; the config takes the names
and the old true/false; the planner counts what each recomputes; ``--fit`` walks the ladder."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from jaxaccel import config, flops
from jaxaccel.models import LLAMA_PRESETS, PRESETS, ModelSpec, build_model, remat
from jaxaccel.models.spec import from_config

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
    """``full`` recomputes the layers' whole forward (a third of their training FLOPs);
    ``save_dot_except_mlp`` the MLP and attention's core; ``save_dot_except_mlpwi`` the MLP's
    gate and up projections and the core; ``minimal`` the core only."""
    shape = flops.model_shape(ModelSpec(LLAMA_PRESETS["llama-1b"]))
    b, s = 4, 2048
    got = {name: flops.recompute_flops(shape, b, s, remat.of(name).recomputes)
           for name in remat.POLICIES}
    layers = flops.train_flops(shape, b, s) - 6.0 * shape.head_weights * b * s
    assert got["full"] == pytest.approx(layers / 3)
    assert got["none"] == 0
    core = flops.attention_flops(shape, b, s) / 3
    assert got["minimal"] == got["minimal_offloaded"] == pytest.approx(core)
    mlp = 2.0 * b * s * shape.layers * 3 * shape.hidden * shape.intermediate
    assert got["save_dot_except_mlp"] == pytest.approx(mlp + core)
    mlp_in = 2.0 * b * s * shape.layers * 2 * shape.hidden * shape.intermediate  # gate, up
    assert got["save_dot_except_mlpwi"] == pytest.approx(mlp_in + core)
    assert got["minimal"] < got["save_dot_except_mlpwi"] < got["save_dot_except_mlp"] \
        < got["save_qkv_proj"] < got["full"]
