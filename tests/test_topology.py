"""Named targets resolve to compile-only devices of the right count and kind; bad names and
missing compilers give one clear error each; the peak table answers per dtype.

TPU targets need libtpu and GPU targets the CUDA plugin (the ``aot`` extra); without them those
tests skip and say so. Compile-only CUDA devices also need ``JAX_PLATFORMS=cpu`` on a machine
without a GPU (the plugin's own backend fails to start there)."""
import jax
import pytest

from jaxaccel import devices, precision
from jaxaccel.distributed import cpu_without_accelerator
from jaxaccel.plan import topology
from jaxaccel.sharding import make_mesh
from support import needs_cuda_plugin, needs_libtpu


@needs_libtpu
@pytest.mark.parametrize("name,devices_,chips,kind,hosts", [
    ("v5e-8", 8, 8, "TPU v5 lite", 1),         # one 8-chip host, as rented
    ("v5e:1x1", 1, 1, "TPU v5 lite", 1),
    ("v5p-8", 4, 4, "TPU v5", 1),              # Cloud counts v5p in TensorCores: 4 chips
    ("v4:2x2x1", 8, 4, "TPU v4", 1),           # deviceless v4: one device per TensorCore
    ("v6e:2x4", 8, 8, "TPU v6 lite", 1),
    ("v5e:4x4", 16, 16, "TPU v5 lite", 4),
    ("v5p-512", 256, 256, "TPU v5", 64),       # MaxText's Llama-2 70B recipe's slice
])
def test_tpu_slices_resolve(name, devices_, chips, kind, hosts):
    t = topology.resolve(name)
    assert (t.platform, len(t.devices), t.chips, t.device_kind, t.hosts) == \
        ("tpu", devices_, chips, kind, hosts)
    assert t.hbm_per_device == t.chip.hbm_bytes * chips / devices_


@needs_cuda_plugin
@pytest.mark.parametrize("name,n,kind,hosts", [
    ("h100:1x8", 8, "NVIDIA H100 80GB HBM3", 1), ("h100:2x8", 16, "NVIDIA H100 80GB HBM3", 2),
    ("a100:1x1", 1, "NVIDIA A100-SXM4-80GB", 1)])
def test_gpu_targets_resolve(name, n, kind, hosts):
    t = topology.resolve(name)
    assert (t.platform, len(t.devices), t.chips, t.device_kind, t.hosts) == \
        ("gpu", n, n, kind, hosts)
    assert t.chip.hbm_bytes == 80e9


@needs_cuda_plugin
def test_the_h200_target_is_an_h200():
    """The compile-only H200 (openxla's spec: the H100 SXM's chip with 4.8 TB/s of HBM3e and
    141 GB) has the chip a real H200 reports as "NVIDIA H200": its peaks, bandwidth and
    memory, and so its fp8 break-even width (``precision.fp8_break_even``) in plans."""
    t = topology.resolve("h200:1x8")
    assert (t.platform, len(t.devices), t.device_kind) == ("gpu", 8, "NVIDIA H200 141GB HBM3e")
    assert t.chip is devices.chip("NVIDIA H200")
    assert (t.chip.hbm_bytes, t.chip.hbm_bandwidth) == (141e9, 4.8e12)
    assert round(precision.fp8_break_even(t.device_kind)) == 535


def test_local_is_the_devices_at_hand():
    t = topology.resolve("local")
    assert t.devices == tuple(jax.devices()) and t.device_kind == jax.devices()[0].device_kind


@pytest.mark.parametrize("generation,dims,wrap", [
    ("v5p", [2, 2, 4], (False,) * 3), ("v5p", [2, 4, 4], (False,) * 3),
    ("v5p", [4, 4, 4], (True,) * 3), ("v5p", [4, 4, 8], (True,) * 3),
    ("v4", [4, 8, 8], (True,) * 3),
    ("v5e", [4, 8, 1], (False,) * 3), ("v6e", [8, 16, 1], (False, True, False)),
    ("v5e", [16, 16, 1], (True, True, False))])
def test_slices_wrap_around_as_the_real_ones(generation, dims, wrap):
    """MaxText's ``wrap`` for these slices (``accelerator_to_spec_map``)."""
    assert topology.wraparound(generation, dims) == wrap


@needs_libtpu
def test_a_whole_v5p_128_gathers_with_an_all_gather():
    """FSDP over its 4x4x4 torus (the trainer's mesh): without the wraparound links libtpu
    made a zero-padded all-reduce."""
    mesh = make_mesh({"fsdp": 64}, topology.resolve("v5p-128").devices)
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    x = jax.ShapeDtypeStruct((64, 128), jax.numpy.bfloat16, sharding=sharded)
    gather = jax.jit(lambda x: x * 2, out_shardings=sharded.update(spec=()))
    hlo = gather.lower(x).compile().as_text()
    assert " all-gather(" in hlo and " all-reduce(" not in hlo


@pytest.mark.parametrize("name,why", [
    ("v9:2x2", "no target 'v9'"), ("v5e:big", "expected a chip grid"),
    ("h100:8", "expected <hosts>x<gpus per host>"), ("h100:0x8", "expected <hosts>x")])
def test_unknown_names_list_the_known_ones(name, why):
    with pytest.raises(topology.TopologyError, match=why) as e:
        topology.resolve(name)
    assert "v5e:2x4" in str(e.value) and "h100:1x8" in str(e.value) and "local" in str(e.value)


@needs_libtpu
def test_a_grid_libtpu_rejects_says_what_libtpu_said():
    with pytest.raises(topology.TopologyError, match="libtpu: .*v5e:3x3"):
        topology.resolve("v5e:3x3")


@pytest.mark.parametrize("name,package,pip", [
    ("v5e:2x2", "libtpu", "jax[tpu]"), ("h100:1x8", "CUDA plugin", "jax[cuda12-local]")])
def test_a_missing_compiler_names_the_pip_command(monkeypatch, name, package, pip):
    monkeypatch.setattr(topology.importlib.util, "find_spec", lambda _: None)
    with pytest.raises(topology.TopologyError, match=package) as e:
        topology.resolve.__wrapped__(name)      # uncached: as on a machine without it
    assert f'pip install "{pip}=={jax.__version__}"' in str(e.value)


def test_peak_table_per_dtype():
    assert devices.peak_rate("NVIDIA H100 80GB HBM3", "float8")[0] == 1979e12
    assert devices.peak_rate("TPU v5 lite", "bfloat16")[0] == 197e12
    # No fp8 units on A100: fp8 runs at the bf16 rate, and the answer says so.
    flops, which = devices.peak_rate("NVIDIA A100-SXM4-80GB", "float8")
    assert flops == 312e12 and "bf16 peak" in which
    assert devices.peak_rate("cpu") is None and devices.peak_bf16("TPU v4") == 275e12


def test_the_cpu_is_chosen_only_where_nothing_else_is(monkeypatch):
    """``jaxaccel`` commands (and the suite) choose the CPU backend before any starts when no
    platform is chosen and no accelerator is attached, so the aot extra's plugins stay quiet."""
    monkeypatch.setattr(jax.config, "update", lambda *a: None)    # this process keeps its own
    chosen = {"JAX_PLATFORMS": "cuda"}
    assert not cpu_without_accelerator(chosen) and chosen == {"JAX_PLATFORMS": "cuda"}
    env = {}
    assert not cpu_without_accelerator(env, attached=lambda: True) and env == {}
    assert cpu_without_accelerator(env, attached=lambda: False) and env == {"JAX_PLATFORMS": "cpu"}
