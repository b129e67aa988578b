"""Loop trip counts read from optimized HLO text as the compilers print it: XLA's
``known_trip_count``, else the condition's bound (signed or unsigned, either side of the
comparison), the counter's start in the loop's initial tuple and the body's step; nested loops
multiply; a loop that cannot be read counts once and says so."""
import pytest

from jaxaccel.plan.loops import loops, runs


def loop_module(dtype="s32", start=0, bound=4, step=1, direction="LT", flip=False,
                known="") -> str:
    """A module whose entry runs one while loop: counter ``dtype`` from ``start``,
    ``i <direction> bound`` (``bound <direction> i`` when ``flip``), stepping by ``step``."""
    compare = (f"%bound, %i), direction={direction}" if flip else
               f"%i, %bound), direction={direction}")
    return f"""%body (p: ({dtype}[], f32[8])) -> ({dtype}[], f32[8]) {{
  %p = ({dtype}[]{{:T(128)}}, f32[8]{{0}}) parameter(0)
  %i = {dtype}[]{{:T(128)}} get-tuple-element(%p), index=0
  %c = {dtype}[]{{:T(128)}} copy(%i)
  %step = {dtype}[]{{:T(128)}} constant({step})
  %next = {dtype}[]{{:T(128)S(6)}} add(%c, %step), metadata={{op_name="add"}}
  %x = f32[8]{{0}} get-tuple-element(%p), index=1
  ROOT %t = ({dtype}[]{{:T(128)}}, /*index=1*/f32[8]{{0}}) tuple(%next, %x)
}}

%cond (p: ({dtype}[], f32[8])) -> pred[] {{
  %bound = {dtype}[]{{:T(128)}} constant({bound}), metadata={{op_name="dot_general"}}
  %p = ({dtype}[]{{:T(128)}}, f32[8]{{0}}) parameter(0)
  %i = {dtype}[]{{:T(128)}} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{{:T(512)}} compare({compare}, backend_config={{"flag_configs":[]}}
}}

ENTRY %main (x: f32[8]) -> f32[8] {{
  %zero = {dtype}[]{{:T(128)}} constant({start})
  %x = f32[8]{{0}} parameter(0)
  %copy.1 = {dtype}[]{{:T(128)}} copy(%zero)
  %init = ({dtype}[]{{:T(128)}}, f32[8]{{0}}) tuple(%copy.1, %x)
  %while = ({dtype}[]{{:T(128)}}, f32[8]{{0}}) while(%init), condition=%cond, body=%body{known}
  ROOT %out = f32[8]{{0}} get-tuple-element(%while), index=1
}}"""


@pytest.mark.parametrize("dtype", ["s32", "u32", "s64", "u64", "u8"])
def test_the_bound_may_be_signed_or_unsigned(dtype):
    """The TPU compiler writes its own loops (windowed FSDP matmuls) with u32 counters."""
    assert runs(loop_module(dtype))["body"] == 4
    assert runs(loop_module(dtype))["cond"] == 5


@pytest.mark.parametrize("start,bound,step,direction,flip,trips", [
    (0, 4, 2, "LT", False, 2),      # libtpu's windowed all-gather matmul on 8 chips
    (0, 5, 2, "LT", False, 3),
    (1, 6, 1, "LT", False, 5),
    (0, 4, 1, "LE", False, 5),
    (0, 4, 1, "GT", True, 4),       # 4 > i
    (0, 6, 3, "NE", False, 2),
    (5, 0, -1, "GT", False, 5),     # counting down
    (5, 0, -1, "GE", False, 6),
    (4, 2, 1, "LT", False, 0),
])
def test_trips_from_start_bound_and_step(start, bound, step, direction, flip, trips):
    (loop,) = loops(loop_module("u32" if step > 0 else "s32", start, bound, step, direction,
                                flip))
    assert loop.trips == trips, loop.how


def test_known_trip_count_is_taken_as_written():
    hlo = loop_module(bound=9, known=', backend_config={"known_trip_count":{"n":"3"}}')
    (loop,) = loops(hlo)
    assert (loop.trips, loop.how) == (3, "known_trip_count") and runs(hlo)["body"] == 3


def test_a_loop_it_cannot_read_runs_once_and_says_why():
    hlo = loop_module().replace("constant(1)", "parameter(1)")      # the step is not constant
    (loop,) = loops(hlo)
    assert loop.trips is None and "step" in loop.how and runs(hlo)["body"] == 1


def test_nested_loops_multiply_and_callees_run_with_their_caller():
    inner = loop_module("u32", bound=4).replace("%body", "%inner").replace("%cond", "%icond")
    inner = inner.replace("ENTRY %main (x: f32[8]) -> f32[8]", "%outer.body (x: f32[8]) -> "
                                                               "f32[8]")
    outer = loop_module("s32", bound=3).replace("%body", "%outer.wrap").replace(
        "%x = f32[8]{0} get-tuple-element(%p), index=1",
        "%x.0 = f32[8]{0} get-tuple-element(%p), index=1\n"
        "  %x = f32[8]{0} fusion(%x.0), kind=kLoop, calls=%outer.body")
    times = runs(inner + "\n\n" + outer)
    assert times["outer.wrap"] == 3 and times["outer.body"] == 3
    assert times["inner"] == 12 and times["icond"] == 15 and times["main"] == 1
