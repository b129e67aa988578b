"""jaxaccel: fast, backend-identical transformer training in JAX/Flax.

Modules: ``config`` (schema, loading, overrides), ``precision`` (dtype policies),
``sharding`` (mesh and logical-axis rules), ``models`` (Flax NNX BERT, HF import),
``optim`` (optax optimizers by name, Adan), ``data`` (TFDS datasets, tokenization,
batching), ``train`` (state, step, loop, checkpoints, metrics), ``cli``.
"""
__version__ = "0.1.0"
