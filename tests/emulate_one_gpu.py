"""pytest plugin that makes the CPU look like a one-GPU machine to the tests' device handling:
``jax.devices()`` (the default backend's) returns one device while ``jax.devices("cpu")`` keeps
the 8 fake ones, and the default backend says "gpu" (so the kernels dispatch as on a GPU
wherever their operands carry no placement). It exercises the one-GPU branch of
``conftest.eight_device_placement`` (meshes, default device and kernels all put back on CPU)::

    python -m pytest -p tests.emulate_one_gpu -m "not gpu" tests/test_sharding.py

(Deselect ``gpu``: those tests would run, and need a real GPU.)"""
import jax

_devices = jax.devices


def _one_default_device(backend=None):
    return _devices(backend) if backend is not None else _devices()[:1]


jax.devices = _one_default_device
jax.default_backend = lambda: "gpu"
