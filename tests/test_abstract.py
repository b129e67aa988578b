"""A model built abstractly (plans, ``jaxaccel compile``, a saved run's restore) costs what its
size costs, not its square: no error message walks the trace (``models/abstract.py``)."""
import jax
from flax import nnx
from jax._src import core
from jax._src.interpreters import partial_eval as pe

from jaxaccel.models import LLAMA_PRESETS, ModelSpec, build_model
from jaxaccel.models.abstract import _walks_the_trace, build_abstract


def test_an_abstract_model_is_nnx_eval_shapes_without_walking_the_trace(monkeypatch):
    walks = []
    original = pe.DynamicJaxprTracer._origin_msg
    monkeypatch.setattr(pe.DynamicJaxprTracer, "_origin_msg",
                        lambda self: walks.append(1) or original(self))
    spec = ModelSpec(LLAMA_PRESETS["llama-tiny"])
    getter = core.Tracer.sharding
    ours = build_abstract(lambda: build_model(spec, "bf16"))
    assert walks == [] and core.Tracer.sharding is getter
    theirs = nnx.eval_shape(lambda: build_model(spec, "bf16"))
    # jax 0.10 walks the trace at every key draw (what the module avoids); jax 0.12 never.
    assert bool(walks) == _walks_the_trace()

    def described(model):
        state = nnx.state(model, nnx.Param)
        return (jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), nnx.to_pure_dict(state)),
                nnx.to_pure_dict(nnx.get_partition_spec(state)))

    assert described(ours) == described(theirs)
