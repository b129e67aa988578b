"""Collectives read from optimized HLO text: each counted once per execution (loop bodies per
trip), its replica group's size in every notation XLA prints, libtpu's fused reduce-scatter
named as such, and the least bytes a device sends (the interconnect bound of `jaxaccel
compile`'s roofline)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxaccel.plan import topology
from jaxaccel.plan.collectives import (Collective, collective_bytes, collectives, dcn_sent,
                                        group_size, ici_sent)
from support import needs_cuda_plugin, needs_libtpu


def test_an_async_pair_counts_its_results_once():
    """Counted at the "-done" (the results): a "-start" returns the operands too on GPU and
    TPU (a reduce-scatter's whole input), which would count them as moved."""
    hlo = """ENTRY %main {
  %ag = (bf16[1,64]{1,0}, bf16[8,64]{1,0}) all-gather-start(%p), channel_id=1
  %agd = bf16[8,64]{1,0} all-gather-done(%ag)
  %rs = ((f32[64]{0}, f32[64,2]{1,0}), (f32[8]{0}, f32[8,2]{1,0})) reduce-scatter-start(%a, %b)
  %rsd = (f32[8]{0}, /*index=1*/f32[8,2]{1,0}) reduce-scatter-done(%rs)
  %cp = (pred[4]{0}, pred[4]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%q)
  %cpd = pred[4]{0} collective-permute-done(%cp)
  ROOT %ar = f32[16]{0:T(256)} all-reduce(%x), to_apply=%add
  %f = f32[1024]{0} fusion(%p), kind=kLoop, calls=%all-gather.1
}"""
    assert collective_bytes(hlo) == {
        "all-gather": 8 * 64 * 2, "reduce-scatter": (8 + 16) * 4, "collective-permute": 4,
        "all-reduce": 16 * 4, "all-to-all": 0}


@pytest.mark.parametrize("attributes,size", [
    ("channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true", 4),
    ("replica_groups=[4,2]<=[8], use_global_device_ids=true", 2),
    ("replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}", 4),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
     "{'axis_0'}, dimensions={0}", 4),
    ("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
     "{'axis_2'}, use_global_device_ids=true", 2),
    ("replica_groups=mesh['x'=2,'y'=3,'z'=2] {'x','z'}, to_apply=%add", 4),
    # a sub-axis (MaxText's llama-1b over fsdp=4 x tensor=2 on v5e-8): 2 of fsdp's 4 ways
    ("replica_groups=mesh['data'=1,'fsdp'=4,'tensor'=2] {'fsdp':(2)2}, dimensions={0}", 2),
    ("replica_groups=mesh['x'=4,'y'=2] {'y','x':(1)2}, dimensions={0}", 4),
    ("replica_groups={}, to_apply=%add", 8),         # one group of all the module's devices
    ("to_apply=%add", 8),
])
def test_group_size_reads_every_notation(attributes, size):
    assert group_size(attributes, devices=8) == size


def test_done_takes_its_starts_group_and_the_fused_reduce_scatter_is_one():
    hlo = """%all-reduce-scatter.3 (input: f32[256,512]) -> f32[64,512] {
  %input = f32[256,512]{1,0:T(8,128)S(1)} parameter(0)
  %all-reduce.2 = f32[256,512]{1,0:T(8,128)} all-reduce(%input), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add.clone
  ROOT %dynamic-slice.5 = f32[64,512]{1,0:T(8,128)S(1)} dynamic-slice(%all-reduce.2, %m, %c)
}

ENTRY %main (p: f32[64,512]) -> f32[64,512] {
  %all-gather-start = (f32[64,512]{1,0}, f32[256,512]{1,0}) all-gather-start(%param), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, dimensions={0}
  %all-gather-done = f32[256,512]{1,0} all-gather-done(%all-gather-start), metadata={op_name="x"}
  %fusion = f32[64,512]{1,0:T(8,128)S(1)} fusion(%fusion.1), kind=kCustom, calls=%all-reduce-scatter.3
  ROOT %all-reduce.1 = f32[64,512]{1,0} all-reduce(%fusion), channel_id=4, replica_groups=[4,2]<=[8], to_apply=%add
}"""
    full = 256 * 512 * 4
    assert collectives(hlo, devices=8) == [
        Collective("reduce-scatter", full // 4, 4), Collective("all-gather", full, 4),
        Collective("all-reduce", full // 4, 2)]
    # Ring (bandwidth-optimal) traffic per device: reduce-scatter and all-gather (n-1)/n of
    # the whole array, all-reduce 2(n-1)/n of its array.
    assert [c.sent for c in collectives(hlo, devices=8)] == [
        0.75 * full, 0.75 * full, 2 * 0.5 * full / 4]


def test_one_device_sends_nothing_but_a_permute_always_sends():
    assert Collective("all-reduce", 1024, 1).sent == 0
    assert Collective("all-gather", 1024, 1).sent == 0
    assert Collective("collective-permute", 1024, 2).sent == 1024
    assert Collective("all-to-all", 1024, 4).sent == 768


def test_a_loop_body_runs_once_per_trip():
    """A collective in a while body counts once per trip: XLA's known trip count where it
    prints one, else the loop's counter (libtpu prints none: here `i < 3` from 0 by 1,
    jaxaccel.plan.loops); a fusion in the body runs as often as the body."""
    hlo = """%fused (p: f32[8]) -> f32[8] {
  ROOT %all-reduce.1 = f32[8]{0} all-reduce(%p), replica_groups=[1,2]<=[2], to_apply=%add
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%t), index=0
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  %all-gather.2 = f32[16]{0} all-gather(%x), replica_groups=[1,2]<=[2], dimensions={0}
  %fusion.3 = f32[8]{0} fusion(%y), kind=kCustom, calls=%fused
  ROOT %out = (s32[]{:T(128)}, f32[8]{0}) tuple(%next, %fusion.3)
}

%cond (t: (s32[], f32[8])) -> pred[] {
  %constant.9 = s32[]{:T(128)} constant(3)
  %t = (s32[]{:T(128)}, f32[8]{0}) parameter(0)
  %gte = s32[]{:T(128)} get-tuple-element(%t), index=0
  ROOT %lt.4 = pred[]{:T(512)} compare(%gte, %constant.9), direction=LT
}

%body.2 (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %all-gather.5 = f32[4]{0} all-gather(%x), replica_groups=[1,2]<=[2], dimensions={0}
}

ENTRY %main (p: f32[8]) -> f32[8] {
  %zero = s32[]{:T(128)} constant(0)
  %t0 = (s32[], f32[8]) tuple(%zero, %p)
  %while = (s32[], f32[8]) while(%t0), condition=%cond, body=%body
  %while.2 = (s32[], f32[8]) while(%t1), condition=%cond.2, body=%body.2, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %all-reduce.6 = f32[2]{0} all-reduce(%z), replica_groups=[1,2]<=[2], to_apply=%add
}"""
    assert collective_bytes(hlo) == {"all-gather": 3 * 64 + 5 * 16, "all-reduce": 3 * 32 + 8,
                                     "reduce-scatter": 0, "all-to-all": 0,
                                     "collective-permute": 0}


def test_the_tpu_compilers_own_loops_count_per_trip():
    """libtpu's windowed FSDP matmul: an unsigned counter from 0 to 4 by 2, so 2 trips of the
    permutes in its body (read as 1 trip when only signed bounds were read, as 4 when the
    step was taken to be 1)."""
    hlo = """%windowed_body (p: (u32[], bf16[1,256,64])) -> (u32[], bf16[1,256,64]) {
  %p = (u32[]{:T(128)}, bf16[1,256,64]{2,1,0}) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  %two = u32[]{:T(128)} constant(2)
  %next = u32[]{:T(128)S(6)} add(%i, %two)
  %x = bf16[1,256,64]{2,1,0} get-tuple-element(%p), index=1
  %cp = (bf16[1,256,64]{2,1,0}, bf16[1,256,64]{2,1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cpd = bf16[1,256,64]{2,1,0} collective-permute-done(%cp)
  ROOT %t = (u32[]{:T(128)}, bf16[1,256,64]{2,1,0}) tuple(%next, %cpd)
}

%windowed_cond (p: (u32[], bf16[1,256,64])) -> pred[] {
  %four = u32[]{:T(128)} constant(4), metadata={op_name="jit(step)/jvp()/dot_general"}
  %p = (u32[]{:T(128)}, bf16[1,256,64]{2,1,0}) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %four), direction=LT
}

ENTRY %main (x: bf16[1,256,64]) -> bf16[1,256,64] {
  %zero = u32[]{:T(128)} constant(0)
  %x = bf16[1,256,64]{2,1,0} parameter(0)
  %c = u32[]{:T(128)} copy(%zero)
  %init = (u32[]{:T(128)}, bf16[1,256,64]{2,1,0}) tuple(%c, %x)
  %while = (u32[]{:T(128)}, bf16[1,256,64]{2,1,0}) while(%init), condition=%windowed_cond, body=%windowed_body
  ROOT %out = bf16[1,256,64]{2,1,0} get-tuple-element(%while), index=1
}"""
    assert collective_bytes(hlo, 8)["collective-permute"] == 2 * 256 * 64 * 2
    unsigned_by_one = hlo.replace("constant(2)", "constant(1)")
    assert collective_bytes(unsigned_by_one, 8)["collective-permute"] == 4 * 256 * 64 * 2


def test_the_tpu_compilers_async_clones_of_one_collective_count_once():
    """libtpu runs an overlapped collective as a chain of fusions (start, the computation it
    overlaps, done), each computation holding a clone of the collective with the same
    channel id: one collective."""
    hlo = """%fused_start (p: bf16[1,64,512]) -> (bf16[1,64,512], bf16[1,512,512], u32[]) {
  %ag.1 = bf16[1,512,512]{2,1,0} all-gather(%p), channel_id=7, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={1}, frontend_attributes={chain_id="0"}
  ROOT %cc = (bf16[1,64,512]{2,1,0}, bf16[1,512,512]{2,1,0}, u32[]{:S(2)}) custom-call(%ag.1), custom_call_target="AsyncCollectiveStart"
}

%async_collective_fusion (p: bf16[1,64,512]) -> (f32[8,512], bf16[1,512,512]) {
  %ag.2 = bf16[1,512,512]{2,1,0} all-gather(%p), channel_id=7, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={1}, frontend_attributes={chain_id="0"}
  %conv = f32[8,512]{1,0} convolution(%a, %b), dim_labels=bf_io->bf
  ROOT %t = (f32[8,512]{1,0}, bf16[1,512,512]{2,1,0}) tuple(%conv, %ag.2)
}

%fused_done (p: bf16[1,64,512]) -> bf16[1,512,512] {
  %ag.3 = bf16[1,512,512]{2,1,0} all-gather(%p), channel_id=7, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={1}, frontend_attributes={chain_id="0"}
  ROOT %cd = bf16[1,512,512]{2,1,0} custom-call(%p, %ag.3), custom_call_target="AsyncCollectiveDone"
}

ENTRY %main (x: bf16[1,64,512]) -> bf16[1,512,512] {
  %x = bf16[1,64,512]{2,1,0} parameter(0)
  %start = (bf16[1,64,512]{2,1,0}, bf16[1,512,512]{2,1,0}, u32[]{:S(2)}) fusion(%x), kind=kCustom, calls=%fused_start
  %mid = (f32[8,512]{1,0}, bf16[1,512,512]{2,1,0}) fusion(%start), kind=kCustom, calls=%async_collective_fusion
  %done = bf16[1,512,512]{2,1,0} fusion(%mid), kind=kCustom, calls=%fused_done
  ROOT %ag.4 = bf16[1,512,512]{2,1,0} all-gather(%x), channel_id=8, replica_groups=mesh['axis_0'=8] {'axis_0'}, dimensions={1}
}"""
    assert collectives(hlo, 8) == [Collective("all-gather", 512 * 512 * 2, 8)] * 2


def test_a_chain_repeated_outside_its_loop_with_the_same_channel_counts_in_each():
    """The compiler repeats a loop's overlapped collective (a peeled trip in the entry) with
    the loop body's channel ids: each computation that runs a chain counts it once."""
    chain = """%start_{s} (p: bf16[1,64,512]) -> bf16[1,512,512] {{
  %ag.{s}1 = bf16[1,512,512]{{2,1,0}} all-gather(%p), channel_id=7, replica_groups=mesh['axis_0'=8] {{'axis_0'}}, dimensions={{1}}
  ROOT %cc.{s} = bf16[1,512,512]{{2,1,0}} custom-call(%ag.{s}1), custom_call_target="AsyncCollectiveStart"
}}

%done_{s} (p: bf16[1,512,512]) -> bf16[1,512,512] {{
  %ag.{s}2 = bf16[1,512,512]{{2,1,0}} all-gather(%p), channel_id=7, replica_groups=mesh['axis_0'=8] {{'axis_0'}}, dimensions={{1}}
  ROOT %cd.{s} = bf16[1,512,512]{{2,1,0}} custom-call(%p, %ag.{s}2), custom_call_target="AsyncCollectiveDone"
}}
"""
    hlo = chain.format(s="body") + chain.format(s="entry") + """
%body (x: bf16[1,64,512]) -> bf16[1,512,512] {
  %x = bf16[1,64,512]{2,1,0} parameter(0)
  %s = bf16[1,512,512]{2,1,0} fusion(%x), kind=kCustom, calls=%start_body
  ROOT %d = bf16[1,512,512]{2,1,0} fusion(%s), kind=kCustom, calls=%done_body
}

ENTRY %main (x: bf16[1,64,512]) -> bf16[1,512,512] {
  %x = bf16[1,64,512]{2,1,0} parameter(0)
  %looped = bf16[1,512,512]{2,1,0} call(%x), to_apply=%body
  %s = bf16[1,512,512]{2,1,0} fusion(%x), kind=kCustom, calls=%start_entry
  ROOT %d = bf16[1,512,512]{2,1,0} fusion(%s), kind=kCustom, calls=%done_entry
}"""
    assert collectives(hlo, 8) == [Collective("all-gather", 512 * 512 * 2, 8)] * 2


def _reduced(target: str, micro: int) -> int:
    """Gradient-reduction bytes of a compiled scan over ``micro`` micro-batches (the trainer's
    `train.grad_accum`) with FSDP-sharded weights, on ``target``'s devices."""
    mesh = Mesh(np.array(topology.resolve(target).devices), ("fsdp",))

    def step(w, x):
        def body(acc, xb):
            return acc + jax.grad(lambda w: jnp.sum(jnp.tanh(xb @ w)))(w), None
        return jax.lax.scan(body, jnp.zeros_like(w), x)[0]

    w = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    x = jax.ShapeDtypeStruct((micro, 64, 256), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "fsdp")))
    hlo = jax.jit(step, out_shardings=NamedSharding(mesh, P("fsdp"))).lower(w, x) \
        .compile().as_text()
    moved = collective_bytes(hlo, mesh.size)
    return moved["all-reduce"] + moved["reduce-scatter"]


@pytest.mark.parametrize("target", [
    "local",
    pytest.param("v5e:2x4", marks=[pytest.mark.aot_compile, needs_libtpu]),  # trip count from i < N
    pytest.param("h100:1x8", marks=[pytest.mark.aot_compile, needs_cuda_plugin]),
])
def test_gradient_accumulation_reduces_once_per_micro_batch(target):
    """The gradient reduction in the loop body runs per micro-batch on every compiler, so
    twice the micro-batches reduce twice the bytes."""
    if target == "local" and len(jax.devices()) < 2:
        pytest.skip("needs 2 or more devices (the suite forces 8 host devices)")
    assert _reduced(target, 8) == 2 * _reduced(target, 4) > 0


@pytest.mark.aot_compile
@needs_libtpu
def test_a_scan_over_fsdp_layers_gathers_each_layer_once_each_way():
    """A scan over L FSDP-sharded layers compiled for a v5e-8: every trip gathers its layer's
    weight for the forward and again for the backward, and reduces its gradient once: 2L
    gathers and L reductions, however the compiler overlaps them (async clones)."""
    mesh = Mesh(np.array(topology.resolve("v5e:2x4").devices), ("fsdp",))
    layers, d = 6, 512

    def loss(w, x):
        return jnp.sum(jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0])

    w = jax.ShapeDtypeStruct((layers, d, d), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "fsdp")))
    x = jax.ShapeDtypeStruct((64, d), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    hlo = jax.jit(jax.grad(loss)).lower(w, x).compile().as_text()
    kinds = [c.kind for c in collectives(hlo, mesh.size)]
    assert kinds.count("all-gather") == 2 * layers
    assert kinds.count("all-reduce") + kinds.count("reduce-scatter") == layers


def test_transfers_between_slices_are_collectives_over_dcn():
    """Across slices libtpu compiles one slice's program, each collective's part between the
    slices a recv from the multi-slice runtime (its transfer type, its groups of devices
    across slices in either notation): counted once each (not its send), as the collective it
    is, over DCN; the rest within the slice."""
    runtime = 'is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name=' \
              '"xla_megascale_runtime",_xla_host_transfer_rendezvous="r"'
    hlo = f"""ENTRY %main {{
  %ar = f32[4,256]{{1,0}} all-reduce(%x), channel_id=2, replica_groups={{{{0,4}},{{1,5}}}}
  %s = (f32[2,256]{{1,0}}, u32[], token[]) send(%ar, %t), channel_id=3, {runtime},_xla_megascale_target="{{1,2}}x{{0:7}}",_xla_megascale_transfer_type="ALL_REDUCE"}}
  %r = (f32[2,256]{{1,0}}, u32[], token[]) recv(%t), channel_id=4, {runtime},_xla_megascale_target="{{1,2}}x{{0:7}}",_xla_megascale_transfer_type="ALL_REDUCE"}}
  %rd = (f32[2,256]{{1,0}}, token[]) recv-done(%r), channel_id=4, is_host_transfer=true
  %g = (f32[128,64]{{1,0}}, u32[], token[]) recv(%t), channel_id=5, {runtime},_xla_megascale_target={{{{100000,200000,300000,400000}},{{100001,200001,300001,400001}}}},_xla_megascale_transfer_type="ALL_GATHER"}}
}}"""
    found = collectives(hlo, 8)
    assert found == [Collective("all-reduce", 4 * 256 * 4, 2),
                     Collective("all-reduce", 2 * 256 * 4, 2, dcn=True),
                     Collective("all-gather", 128 * 64 * 4, 4, dcn=True)]
    assert dcn_sent(found) == 2 * 256 * 4 + 3 / 4 * 128 * 64 * 4
    assert ici_sent(found) == 4 * 256 * 4


@needs_libtpu
def test_data_parallel_between_slices_sums_over_dcn_and_fsdp_within():
    """On 2 x v5e-4 with data over DCN, a gradient summed over the batch axes crosses the
    slices (a transfer between them) while a sum over fsdp alone stays within each."""
    from jaxaccel import sharding
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4, "dcn_data": 2},
                              topology.resolve("2xv5e-4").devices)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32,
                             sharding=NamedSharding(mesh, P(("data", "fsdp"))))

    def summed(axes):
        f = jax.shard_map(lambda v: jax.lax.psum(v, axes), mesh=mesh, in_specs=P(("data", "fsdp")),
                          out_specs=P(("data", "fsdp")))
        return collectives(jax.jit(f).lower(x).compile().as_text(), 4)
    assert dcn_sent(summed(("data", "fsdp"))) > 0
    assert dcn_sent(summed("fsdp")) == 0 and ici_sent(summed("fsdp")) > 0
