"""What a scheduled HLO module runs beside each collective: async pairs and the TPU compiler's
chains of async collective fusions with compute between their start and end (overlapped) or
none (exposed), synchronous collectives, each counted per trip of the loops around it."""
from jaxaccel.plan.collectives import collective_bytes
from jaxaccel.plan.overlap import overlap, scheduled

# A while loop of 4 trips whose body gathers a weight beside a matmul (overlapped), permutes
# with nothing between start and done (exposed) and sums a gradient synchronously; the entry
# runs a chain of async collective fusions (start, a fusion computing while it runs, done) and
# a fused reduce-scatter (one fusion: synchronous) and a reduce-scatter wrapped in async-start
# and async-done with a dot between.
HLO = """%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %j = s32[] get-tuple-element(%b), index=0
  %x = f32[8]{0} get-tuple-element(%b), index=1
  %ags = (bf16[2,64]{1,0}, bf16[16,64]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %matmul = f32[8]{0} fusion(%x), kind=kOutput, calls=%fused_dot
  %agd = bf16[16,64]{1,0} all-gather-done(%ags)
  %cps = (f32[32]{0}, f32[32]{0}, u32[], u32[]) collective-permute-start(%x), channel_id=2, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[32]{0} collective-permute-done(%cps)
  %ar = f32[8]{0} all-reduce(%matmul), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%add
  %one = s32[] constant(1)
  %k = s32[] add(%j, %one)
  ROOT %t = (s32[], f32[8]{0}) tuple(%k, %ar)
}

%fused_dot (p0: f32[8]) -> f32[8] {
  %p0 = f32[8]{0} parameter(0)
  ROOT %d = f32[8]{0} dot(%p0, %p0)
}

%fused_start (p1: bf16[4,32]) -> bf16[32,32] {
  %p1 = bf16[4,32]{1,0} parameter(0)
  ROOT %ag1 = bf16[32,32]{1,0} all-gather(%p1), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}
}

%async_collective_fusion.1 (p2: bf16[4,32]) -> bf16[32,32] {
  %p2 = bf16[4,32]{1,0} parameter(0)
  ROOT %ag2 = bf16[32,32]{1,0} all-gather(%p2), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}
}

%fused_done (p3: bf16[4,32]) -> bf16[32,32] {
  %p3 = bf16[4,32]{1,0} parameter(0)
  ROOT %ag3 = bf16[32,32]{1,0} all-gather(%p3), channel_id=7, replica_groups=[1,8]<=[8], dimensions={0}
}

%all-reduce-scatter.1 (p4: f32[64]) -> f32[8] {
  %p4 = f32[64]{0} parameter(0)
  %ar2 = f32[64]{0} all-reduce(%p4), channel_id=9, replica_groups=[1,8]<=[8], to_apply=%add
  ROOT %ds = f32[8]{0} dynamic-slice(%ar2, %z), dynamic_slice_sizes={8}
}

%wrapped_rs (p5: f32[64]) -> f32[8] {
  %p5 = f32[64]{0} parameter(0)
  ROOT %rs2 = f32[8]{0} reduce-scatter(%p5), channel_id=11, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[8], w: bf16[4,32], g: f32[64]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = bf16[4,32]{1,0} parameter(1)
  %g = f32[64]{0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %a)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %async-collective-start = bf16[32,32]{1,0} fusion(%w), kind=kCustom, calls=%fused_start
  %fusion.2 = bf16[32,32]{1,0} fusion(%async-collective-start), kind=kCustom, calls=%async_collective_fusion.1
  %async-collective-done = bf16[32,32]{1,0} fusion(%fusion.2), kind=kCustom, calls=%fused_done
  %rs = f32[8]{0} fusion(%g), kind=kCustom, calls=%all-reduce-scatter.1
  %rs-start = ((f32[64]{0}), f32[8]{0}) async-start(%g), calls=%wrapped_rs
  %dot.1 = f32[8]{0} dot(%a, %a)
  %rs-done = f32[8]{0} async-done(%rs-start)
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
}
"""


def test_each_collective_is_overlapped_exposed_or_synchronous_per_loop_trip():
    got = overlap(HLO, devices=8)
    gather, permute = 16 * 64 * 2 * 4, 32 * 4 * 4        # per trip, 4 trips
    assert got["all-gather"] == {"bytes": gather + 32 * 32 * 2,
                                 "overlapped": gather + 32 * 32 * 2, "exposed": 0,
                                 "synchronous": 0, "count": 4 + 1}
    assert got["collective-permute"] == {"bytes": permute, "overlapped": 0,
                                         "exposed": permute, "synchronous": 0, "count": 4}
    assert got["all-reduce"] == {"bytes": 8 * 4 * 4, "overlapped": 0, "exposed": 0,
                                 "synchronous": 8 * 4 * 4, "count": 4}
    assert got["reduce-scatter"] == {"bytes": 2 * 8 * 4, "overlapped": 8 * 4, "exposed": 0,
                                     "synchronous": 8 * 4, "count": 2}
    # The bytes are those jaxaccel.plan.collectives counts, kind by kind.
    assert {k: v["bytes"] for k, v in got.items()} == collective_bytes(HLO, devices=8)


def test_what_runs_between_start_and_end_is_counted():
    between = sorted((c.computation, c.kind, c.between, c.synchronous, c.runs)
                     for c in scheduled(HLO, devices=8))
    assert between == [("body", "all-gather", 1, False, 4), ("body", "all-reduce", 0, True, 4),
                       ("body", "collective-permute", 0, False, 4),
                       ("main", "all-gather", 1, False, 1),
                       ("main", "reduce-scatter", 0, True, 1),
                       ("main", "reduce-scatter", 1, False, 1)]
