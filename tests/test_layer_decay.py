"""Layer-wise learning-rate decay: of L layers, layer i's update is scaled by decay**(L - i),
the embeddings' by decay**(L + 1), the head's by 1, on top of any optimizer; the config key
reaches the trainer's optimizer for both model families."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxaccel import config
from jaxaccel.models import spec as model_spec
from jaxaccel.optim import make_optimizer
from jaxaccel.optim.layer_decay import depths
from jaxaccel.precision import get_policy
from jaxaccel.train.run import optimizer_state, resolve

DECAY = 0.5


def _params(name):
    spec = model_spec.from_config(config.build(sets=[f"model.name={name}"]).model)
    model = spec.family.resolve("model")(spec, get_policy("fp32"), nnx.Rngs(params=0))
    return spec, nnx.state(model, nnx.Param)


def _expected_factor(path, layers, embeddings):
    """The rule, written from the path's printed form (independent of layer_decay.depths)."""
    text = jax.tree_util.keystr(path)
    for i in range(layers):
        if text.startswith(f"['layers'][{i}]"):
            return DECAY ** (layers - i)
    if any(text.startswith(f"['{e}']") for e in embeddings):
        return DECAY ** (layers + 1)
    return 1.0


@pytest.mark.parametrize("optimizer", ["adamw", "adan"])
def test_each_layer_steps_at_its_decayed_rate(optimizer):
    spec, params = _params("tiny")
    layers = spec.architecture.num_hidden_layers
    embeddings = spec.family.embeddings
    keys = iter(jax.random.split(jax.random.key(1), 1000))
    grads = jax.tree_util.tree_map(lambda p: jax.random.normal(next(keys), p.shape), params)
    kw = dict(weight_decay=0.1, max_grad_norm=1.0)
    base = make_optimizer(optimizer, 1e-3, **kw)
    decayed = make_optimizer(optimizer, 1e-3, layer_decay=DECAY, embeddings=embeddings, **kw)
    want, _ = base.update(grads, base.init(params), params)
    got, _ = decayed.update(grads, decayed.init(params), params)
    factors = set()
    for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree_util.tree_leaves(want)):
        factor = _expected_factor(path, layers, embeddings)
        factors.add(factor)
        np.testing.assert_allclose(g, np.asarray(w) * factor, rtol=1e-6, atol=1e-12,
                                   err_msg=jax.tree_util.keystr(path))
    assert factors == {DECAY ** k for k in range(layers + 2)}, factors


def test_decoder_depths_put_the_embedding_first_and_norm_and_lm_head_last():
    spec, params = _params("llama-tiny")
    depth, count = depths(params, spec.family.embeddings)
    assert count == spec.architecture.num_hidden_layers
    named = {jax.tree_util.keystr(p): d for p, d in jax.tree_util.tree_flatten_with_path(depth)[0]}
    assert named["['embed_tokens']['embedding'].value"] == 0
    assert named["['layers'][0]['self_attn']['q_proj']['kernel'].value"] == 1
    assert named[f"['layers'][{count - 1}]['mlp']['down_proj']['kernel'].value"] == count
    assert named["['norm']['scale'].value"] == named["['lm_head']['kernel'].value"] == count + 1


def test_a_tree_without_layers_is_refused():
    with pytest.raises(ValueError, match="'layers'"):
        depths({"dense": {"kernel": jnp.zeros(2)}}, ("embeddings",))


@pytest.mark.parametrize("sets, match", [
    (["train.layer_decay=0.0"], r"\(0, 1\]"),
    (["train.layer_decay=1.5"], r"\(0, 1\]"),
])
def test_bad_layer_decay_is_refused(sets, match):
    with pytest.raises(ValueError, match=match):
        config.validate(config.build(sets=sets))


def test_layer_decay_keeps_a_run_off_the_flat_layout():
    """The flat layout's one-pass Adan has one learning rate: ``resolve`` (the layout rule,
    ``train.layout.choose``) refuses the pair before anything is built."""
    cfg = config.build(sets=["model.name=tiny", "train.layer_decay=0.8",
                             "train.optimizer=adan", "train.flat_params=true"])
    with pytest.raises(ValueError, match="layer_decay=1 .*one learning rate"):
        resolve(cfg)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_the_config_key_reaches_the_trainers_optimizer(name):
    """The embedding table's first update is decay**(L + 1) times the undecayed one."""
    updates = []
    spec, params = _params(name)            # the same parameters for both optimizers
    for decay in (1.0, DECAY):
        # Data of the model's task; a decoder's tokenizer named, so no corpus BPE is sized.
        data = ["data.name=canterbury", "model.tokenizer=unused"] if name.startswith("llama") \
            else ["data.name=synthetic"]
        cfg = config.build(sets=[f"model.name={name}", *data, f"train.layer_decay={decay}",
                                 "train.warmup_ratio=0.0"])
        r = resolve(cfg)
        tx, _, create, _ = optimizer_state(r, params, None, None, 10)
        grads = jax.tree_util.tree_map(jnp.ones_like, params)
        update, _ = tx.update(grads, create(params, None).opt_state, params)
        updates.append(jax.tree_util.tree_leaves(update[spec.family.embeddings[0]])[-1])
    assert float(jnp.abs(updates[0]).max()) > 0
    layers = spec.architecture.num_hidden_layers
    np.testing.assert_allclose(updates[1], updates[0] * DECAY ** (layers + 1), rtol=1e-6)
