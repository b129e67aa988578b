"""MaxText's training step beside ours, both compiled ahead of time for the same TPU slice with
the same model, batch, mesh and dtypes: what each program needs and does per chip.

    python bench/maxtext_step.py --model llama-1b --topology v5e-8 --mesh fsdp=8
    python bench/maxtext_step.py --model llama-350m --topology v5e-8 --mesh data=2,fsdp=4
    python bench/maxtext_step.py --topology 2xv5e-256 --mesh data=2,fsdp=256,dcn_data=2 --batch 512
    python bench/maxtext_step.py --model llama-1b --topology v5e-8 --mesh fsdp=4,tensor=2
    python bench/maxtext_step.py ... --sides jaxaccel --ours-set model.remat=false   # ours again

The baseline is MaxText 0.2.5's ``train_compile`` (``pip install 'maxtext[tpu]==0.2.5'``, which
needs Python 3.12), its layers scanned (its default) and unrolled. The script makes its own
virtual environment on first use (``$XDG_CACHE_HOME/jaxaccel`` or ``~/.cache/jaxaccel``, folder
``maxtext-<version>``; Python 3.12 from ``--python``, ``python3.12`` on PATH or pyenv): pip
installs MaxText, ``jax[tpu]`` at ``JAX`` (its libtpu pin: both sides compile with the same
compiler) and jaxaccel's own requirements (setup.cfg); the script then runs itself again in it.

Our side is the trainer's own jitted train step, built abstractly as ``jaxaccel compile``
builds it (``jaxaccel.plan.abstract_run``), at ``OURS`` plus ``--ours-set`` (whose keys
replace OURS's: ``--ours-set model.remat=save_dot_except_mlpwi``). MaxText's settings
are derived from our resolved config (``maxtext_args``): the preset's shapes, the global batch
over the chips, the sequence length, the mesh axes (``--mesh``: ``data``, ``fsdp``, ``tensor``
and, across slices, ``dcn_data``, ``dcn_fsdp``; ours ``mesh.<axis>``, MaxText's
``ici_<axis>_parallelism`` within a slice and ``dcn_<axis>_parallelism`` between), the policy's compute and parameter dtypes,
the remat policy (``models/remat.py``: MaxText's names), the attention kernel (Pallas flash on
both sides), AdamW's b1, b2, eps, weight decay and clipping; the parameter counts of the two
sides must be equal or the script stops. With ``--reuse`` a side compiled before (its
``side.json`` in ``--work``) is analysed again, not compiled: its row says so (``reused``), and
its compile seconds, date and load are the earlier run's.

Each side compiles in a child process of its own (its trace, lowering and compile timed
there in wall and process CPU seconds, on this machine's CPU: on a shared CPU the CPU seconds
are the steadier measure), with XLA's dumps written beside its optimized HLO (``--work``,
default the cache folder): the memory-usage report and live ranges are read from them. Per
chip, each row has: compile seconds, memory (arguments, outputs, temporaries, total; ``memory_analysis()``), HBM bytes and
FLOPs counted with loop trips (``jaxaccel.plan.hlo_cost``) beside the compiler's own figures
(loop bodies once) and those of them that move to or from HBM (each instruction costed alone,
``hlo_cost.by_instruction``, its accesses to buffers the TPU compiler placed in VMEM left out:
``hlo_cost.on_chip``), the bytes each kind of collective writes and the least a chip sends
(``jaxaccel.plan.collectives``) and how much of each kind the schedule overlaps with compute,
leaves exposed or runs synchronously (``jaxaccel.plan.overlap``), and the planner's estimate
of the step (``jaxaccel.plan.estimate_step``) from those numbers; what is live at the step's peak (XLA's
live-range dump), by origin and in its largest groups of one shape; with ``--by-op``, the HBM
bytes by jax operation (``jaxaccel.plan.hlo_cost.by_instruction``). Writes
``<out>/maxtext-<model>-<topology>.json`` and prints a Markdown table and the two commands that
rerun it.
"""
from __future__ import annotations

import argparse
import configparser
import contextlib
import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MAXTEXT = "0.2.5"
JAX = "0.12.0.1"            # its `tpu` extra pins libtpu 0.0.50.*: the compiler of both sides
IN_VENV = "JAXACCEL_MAXTEXT_VENV"
SIDES = ("maxtext-scan", "maxtext-unrolled", "jaxaccel")
# Our side: the decoder job's config (packed causal-LM rows; its AdamW b2 0.95 and weight decay
# 0.1, as MaxText's defaults) at the settings; model, batch, rows and mesh from the flags.
CONFIG = os.path.join(ROOT, "configs", "canterbury_lm.py")
OURS = ["precision.policy=bf16", "model.remat=true", "model.attention_impl=pallas",
        "model.tokenizer=unused", "mesh.stage=1"]
MESH = ("data", "fsdp", "tensor", "dcn_data", "dcn_fsdp")   # --mesh's axes: ours mesh.<axis>


def cache_dir() -> str:
    """``$XDG_CACHE_HOME/jaxaccel``, else ``~/.cache/jaxaccel`` (bench/common.py's)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxaccel")


def python312(given: str | None) -> str:
    """A Python 3.12 that runs: ``given``, else ``python3.12`` on PATH, else pyenv's newest."""
    candidates = [given] if given else [shutil.which("python3.12"), *sorted(glob.glob(
        os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")), reverse=True)]
    for python in filter(None, candidates):
        ran = subprocess.run([python, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True)
        if ran.returncode == 0 and ran.stdout.strip() == "(3, 12)":
            return python
    raise SystemExit(f"MaxText {MAXTEXT} needs Python 3.12: give one with --python")


def requirements() -> list[str]:
    """jaxaccel's install_requires (setup.cfg), so our side runs in MaxText's environment."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    return [r.strip() for r in cfg["options"]["install_requires"].splitlines() if r.strip()]


def ensure_maxtext_venv(python: str | None) -> str:
    """The python of ``cache_dir()/maxtext-<MAXTEXT>``, made (with pip, from PyPI) when missing."""
    venv = os.path.join(cache_dir(), f"maxtext-{MAXTEXT}")
    interpreter = os.path.join(venv, "bin", "python")
    done = os.path.join(venv, ".installed")
    if not os.path.exists(done):
        subprocess.run([python312(python), "-m", "venv", venv], check=True)
        subprocess.run([interpreter, "-m", "pip", "install", "-q", f"maxtext[tpu]=={MAXTEXT}",
                        f"jax[tpu]=={JAX}", *requirements()], check=True)
        open(done, "w").close()
    return interpreter


# ----------------------------------------------------------------------------- the two sides


def our_config(model: str, batch: int, seq: int, mesh: dict, extra: list[str], target):
    from jaxaccel import plan
    given = {kv.partition("=")[0] for kv in extra}     # --ours-set's keys replace OURS's
    sets = [*(kv for kv in OURS if kv.partition("=")[0] not in given),
            f"model.name={model}", f"train.batch_size={batch}",
            f"data.max_len={seq}", f"train.eval_batch_size={batch}",
            *(f"mesh.{axis}={mesh.get(axis, 1)}" for axis in MESH), *extra]
    return plan.load_config(CONFIG, sets, target)


def maxtext_args(cfg, spec, target, topology: str, scan: bool) -> list[str]:
    """MaxText's ``key=value`` overrides for the step ``cfg`` configures (module docstring)."""
    import jax.numpy as jnp

    from jaxaccel.models import remat
    from jaxaccel.precision import policy_of
    a, t, m = spec.architecture, cfg.train, cfg.mesh
    policy = policy_of(cfg.precision)
    if policy.name not in ("bf16", "fp32") or m.stage != 1:
        raise SystemExit(f"bench/maxtext_step.py compares bf16 or fp32 steps over data x fsdp "
                         f"x tensor meshes, not policy {policy.name!r}, mesh {dict(m)}")
    return [
        f"base_emb_dim={a.hidden_size}", f"base_num_query_heads={a.num_attention_heads}",
        f"base_num_kv_heads={a.num_key_value_heads}", f"base_mlp_dim={a.intermediate_size}",
        f"base_num_decoder_layers={a.num_hidden_layers}",
        f"head_dim={a.head_dim or a.hidden_size // a.num_attention_heads}",
        f"vocab_size={a.vocab_size}",
        "decoder_block=llama2", "mlp_activations=[silu,linear]",
        f"logits_via_embedding={str(a.tie_word_embeddings).lower()}",
        f"normalization_layer_epsilon={a.rms_norm_eps}", f"rope_max_timescale={int(a.rope_theta)}",
        "enable_dropout=false", "dropout_rate=0.0",
        f"per_device_batch_size={t.batch_size / len(target.devices)}",
        f"max_target_length={cfg.data.max_len}",
        f"dtype={jnp.dtype(policy.compute_dtype).name}",
        f"weight_dtype={jnp.dtype(policy.param_dtype).name}",
        f"remat_policy={remat.of(cfg.model.remat).name}",        # MaxText's names
        f"attention={'flash' if cfg.model.attention_impl == 'pallas' else 'dot_product'}",
        f"scan_layers={str(scan).lower()}",
        f"ici_data_parallelism={m.data // m.dcn_data}",
        f"ici_fsdp_parallelism={m.fsdp // m.dcn_fsdp}", f"ici_tensor_parallelism={m.tensor}",
        f"dcn_data_parallelism={m.dcn_data}", f"dcn_fsdp_parallelism={m.dcn_fsdp}",
        "opt_type=adamw", f"adam_b1={t.b1 or 0.9}",
        f"adam_b2={t.b2 or 0.999}", f"adam_eps={t.eps or 1e-8}",
        f"adam_weight_decay={t.weight_decay}", f"gradient_clipping_threshold={t.max_grad_norm}",
        f"learning_rate={t.learning_rate}", "dataset_type=synthetic", "enable_checkpointing=false",
        f"compile_topology={topology.partition('x')[2] if target.slices > 1 else topology}",
        f"compile_topology_num_slices={target.slices}",
        "base_output_directory=/tmp/jaxaccel-maxtext", "run_name=bench"]


@contextlib.contextmanager
def timer():
    """Wall and process CPU seconds (all threads) of the block, filled in when it ends: the
    CPU seconds are the compiler's work, less moved by other load on a shared machine."""
    seconds = {}
    wall, cpu = time.perf_counter(), time.process_time()
    yield seconds
    seconds.update(wall=time.perf_counter() - wall, cpu=time.process_time() - cpu)


def compile_maxtext(args: list[str]):
    """``(compiled, {"wall", "cpu"} seconds, parameters)``: MaxText's train step compiled as its
    ``train_compile.main`` compiles it (same functions, same order), without saving it."""
    import jax
    from flax import nnx
    from flax.core.spmd import logical_axis_rules as axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile as tc
    from maxtext.utils import max_utils, maxtext_utils, sharding

    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "")
                                      + " --xla_tpu_spmd_rng_bit_generator_unsafe=true")
    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    config = pyconfig.initialize(["train_compile", base, *args])
    mesh = tc.get_topology_mesh(config)
    shaped_args, shaped_kwargs, state_shardings, _, model = tc.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings)
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(
        config, state_shardings, params_shardings)
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, input_shardings, model, config, params_shardings)
    parameters = max_utils.calculate_num_params_from_pytree(
        shaped_args[0]["model"].filter(nnx.Param))
    with timer() as seconds:
        compiled = tc.jit_and_compile(func, shaped_args, shaped_kwargs, mesh, in_shard,
                                      out_shard, static, donate, config,
                                      axis_rules(config.logical_axis_rules))
    return compiled, seconds, parameters


def compile_ours(cfg, target):
    """``(compiled, {"wall", "cpu"} seconds, parameters)``: the trainer's train step as
    ``jaxaccel compile`` builds it (abstract state and batch on the target's mesh)."""
    import jax

    from jaxaccel import plan
    run = plan.abstract_run(cfg, target)
    batch = plan.abstract_batch(run, cfg.train.batch_size)
    parameters = sum(x.size for x in jax.tree_util.tree_leaves(run.state.params))
    with timer() as seconds, jax.set_mesh(run.mesh):
        compiled = run.train_step.lower(run.state, batch).compile()
    return compiled, seconds, parameters


def compile_side(side: str, a) -> None:
    """Compile one side (in its own process) and keep what the analysis reads in ``a.work``:
    the optimized HLO, XLA's dumps and ``side.json`` (compile seconds, parameters, memory,
    the compiler's own cost analysis)."""
    folder = os.path.join(a.work, name(side, a))
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_dump_to={os.path.join(folder, 'dump')}")
    import jax
    jax.config.update("jax_enable_compilation_cache", False)   # compile, never load

    from bench.common import git_sha
    from jaxaccel import plan
    target, cfg, spec = setting(a)
    if side == "jaxaccel":
        compiled, seconds, parameters = compile_ours(cfg, target)
    else:
        compiled, seconds, parameters = compile_maxtext(
            maxtext_args(cfg, spec, target, a.topology, scan=side == "maxtext-scan"))
    with gzip.open(os.path.join(folder, "hlo.txt.gz"), "wt") as f:
        f.write(compiled.as_text())
    with open(os.path.join(folder, "side.json"), "w") as f:
        json.dump({"side": side, "jaxaccel": git_sha(),
                   "compile_s": seconds["wall"], "compile_cpu_s": seconds["cpu"],
                   "load_average": os.getloadavg(), "parameters": int(parameters),
                   "memory": plan.memory_of(compiled),
                   "compiler_cost": {k: v for k, v in plan.xla_cost(compiled).items()
                                     if k in ("flops", "bytes accessed", "transcendentals",
                                              "optimal_seconds")},
                   "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}, f, indent=1)


def name(side: str, a) -> str:
    """A side's name: ours with its ``--ours-set`` settings (``jaxaccel[model.remat=false]``)."""
    return f"{side}[{','.join(a.ours_set)}]" if side == "jaxaccel" and a.ours_set else side


def result_name(a, sides: list[str]) -> str:
    """The result file's name: the model, target and mesh, then the sides where not all ran
    and each ``--ours-set``'s last key and value (``...-fsdp16-jaxaccel-loss_chunks8.json``),
    so a run of one variant does not overwrite the comparison."""
    parts = [a.model, a.topology, a.mesh.replace(",", "-")]
    parts += ["+".join(sides)] if sides != list(SIDES) else []
    parts += [s.rpartition(".")[2] for s in a.ours_set]
    return "maxtext-" + "-".join(parts).replace("=", "") + ".json"


def setting(a):
    """``(target, our config, our model spec)`` of the flags."""
    from jaxaccel.plan import topology
    from jaxaccel.train.run import resolve
    target = topology.resolve(a.topology)
    cfg = our_config(a.model, a.batch, a.seq, mesh_of(a.mesh), a.ours_set, target)
    return target, cfg, resolve(cfg, target.devices, absent_ok=True).spec


def mesh_of(text: str) -> dict[str, int]:
    """``--mesh``'s ``fsdp=32,tensor=4`` as ``{"fsdp": 32, "tensor": 4}``; an axis not in
    ``MESH``, or a size that is not a whole number, stops the script with the accepted form."""
    mesh = {}
    for item in text.split(","):
        axis, _, size = item.partition("=")
        if axis not in MESH or not size.isdigit():
            raise SystemExit(f"--mesh {text!r}: {item!r} is not AXIS=N with AXIS one of "
                             f"{', '.join(MESH)} (e.g. --mesh fsdp=32,tensor=4)")
        mesh[axis] = int(size)
    return mesh


def analyse(side: str, a, target, cfg, spec) -> dict:
    """One side's row from what ``compile_side`` kept: counted cost, collectives, estimate."""
    from jaxaccel import flops as flops_lib
    from jaxaccel import plan
    from jaxaccel.models import remat
    from jaxaccel.plan import collectives as collectives_lib
    from jaxaccel.plan import hlo_cost, overlap
    from jaxaccel.precision import policy_of
    folder = os.path.join(a.work, name(side, a))
    with open(os.path.join(folder, "side.json")) as f:
        kept = json.load(f)
    with gzip.open(os.path.join(folder, "hlo.txt.gz"), "rt") as f:
        hlo = f.read()
    counted = hlo_cost.count(hlo)
    parts = list(hlo_cost.by_instruction(hlo))      # each instruction costed alone: minutes
    devices = len(target.devices) // target.slices
    found = collectives_lib.collectives(hlo, devices)
    sent, dcn = collectives_lib.ici_sent(found), collectives_lib.dcn_sent(found)
    shape = flops_lib.model_shape(spec)
    batch, seq = cfg.train.batch_size, cfg.data.max_len
    flops = {"analytic": flops_lib.train_flops(shape, batch, seq),
             "attention": flops_lib.attention_flops(shape, batch, seq),
             "recompute": flops_lib.recompute_flops(shape, batch, seq,
                                                    remat.of(cfg.model.remat).recomputes)}
    hbm = hlo_cost.hbm_bytes(parts)
    estimate = plan.estimate_step(target, policy_of(cfg.precision),
                                  spec.attention_impl, flops,
                                  {**kept["compiler_cost"], **counted.totals, "hbm bytes": hbm},
                                  batch, seq, sent, dcn_sent=dcn)
    return {**kept, "name": name(side, a), "counted": counted.as_dict(),
            "collective_bytes": collectives_lib.by_kind(found), "collective_sent": sent,
            "dcn_sent": dcn, "collective_overlap": overlap.overlap(hlo, devices),
            "analytic_flops": flops, "estimate": estimate,
            "largest_allocations": largest_temporaries(os.path.join(folder, "dump")),
            "peak": peak_groups(at_peak(os.path.join(folder, "dump"), hlo)),
            "hbm_bytes": hbm,
            "by_op": by_op(parts) if a.by_op else None}


def _dumped(dump: str, kind: str) -> str:
    """The step's ``after_optimizations-<kind>.txt`` in an XLA dump folder (the largest such
    file, should the process have compiled more than the step); the folder's name taken
    literally (``jaxaccel[train.loss_chunks=8]`` is no glob pattern)."""
    return max(glob.glob(os.path.join(glob.escape(dump), f"*after_optimizations-{kind}.txt")),
               key=os.path.getsize)


def largest_temporaries(dump: str, top: int = 12) -> list[dict]:
    """The largest allocations of the step's default memory space, from XLA's
    memory-usage report in ``dump`` (``--xla_dump_to``): size in bytes and the shapes of the
    values sharing it (an allocation is reused by values whose lives do not overlap)."""
    path = _dumped(dump, "memory-usage-report")
    rows = []
    with open(path) as f:
        for line in f:
            fields = [x.strip() for x in line.split(";")]
            if len(fields) == 5 and fields[1].endswith("B") and fields[2].isdigit():
                rows.append({"bytes": _bytes(fields[1]), "values": fields[4]})
            elif rows and not line.strip():
                break
    return sorted(rows, key=lambda r: -r["bytes"])[:top]


_PEAK = re.compile(r"^  Live ranges at \d+ \(peak\):")
_LIVE = re.compile(r"^    ([\w.\-]+)(\{[\d,]*\}): (\d+) bytes")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LAYOUT = re.compile(r"\{[^}]*\}")


def at_peak(dump: str, hlo: str) -> list[dict]:
    """Every value live at the step's peak, largest first, from XLA's live-range dump: bytes,
    the instruction's shape (layout dropped), its origin (``argument`` of the step; ``loop
    state``; ``AllocateBuffer``: a buffer the TPU compiler allocates ahead of the op that fills
    it; else the opcode) and
    the jax operation it came from (its ``op_name``)."""
    from jaxaccel.plan import loops
    computations, entry = loops.parse(hlo)
    instructions = {n: (i, c) for c, found in computations.items() for n, i in found.items()}
    found, inside = [], False
    with open(_dumped(dump, "live-range")) as f:
        for line in f:
            if _PEAK.match(line):
                inside = True
            elif inside and (m := _LIVE.match(line)):
                i, computation = instructions.get(m.group(1), (None, ""))
                op = _OP_NAME.search(i.attributes) if i else None
                origin = _origin(i, computation == entry)
                found.append({"bytes": int(m.group(3)), "value": m.group(1) + m.group(2),
                              "shape": _LAYOUT.sub("", i.shape) if i else "",
                              "origin": origin, "op_name": op.group(1) if op else ""})
            elif inside:
                break
    return sorted(found, key=lambda r: -r["bytes"])


def _origin(i, in_entry: bool) -> str:
    if i is None:
        return ""
    if '"AllocateBuffer"' in i.attributes:
        return "AllocateBuffer"
    if i.opcode == "parameter":
        return "argument" if in_entry else "loop state"
    return i.opcode


def peak_groups(live: list[dict], top: int = 12) -> dict:
    """The peak's bytes by origin, and its largest groups of values of one shape and origin
    (``count x shape``): what a program holds at its peak, comparable across programs."""
    by_origin, groups = {}, {}
    for v in live:
        by_origin[v["origin"]] = by_origin.get(v["origin"], 0) + v["bytes"]
        g = groups.setdefault((v["shape"], v["origin"]), {"shape": v["shape"],
                                                           "origin": v["origin"], "count": 0,
                                                           "bytes": 0, "op_name": v["op_name"]})
        g["count"] += 1
        g["bytes"] += v["bytes"]
    return {"bytes": sum(by_origin.values()), "by_origin": by_origin,
            "largest": sorted(groups.values(), key=lambda g: -g["bytes"])[:top]}


def _bytes(size: str) -> int:
    """``704.00MiB`` -> bytes."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10), ("B", 1)):
        if size.endswith(unit):
            return round(float(size[:-len(unit)]) * scale)
    raise ValueError(size)


ROWS = (("parameters", lambda r: f"{r['parameters']:,}"),
        ("trace, lower, compile the train step: wall s (CPU s)",
         lambda r: f"{r['compile_s']:.0f} ({r.get('compile_cpu_s', float('nan')):.0f})"),
        ("arguments (GB)", lambda r: _gb(r["memory"]["arguments"])),
        ("temporaries (GB)", lambda r: _gb(r["memory"]["temp"])),
        ("total memory (GB)", lambda r: _gb(r["memory"]["total"])),
        ("compiler's peak, peak_memory_in_bytes (GB)", lambda r: _gb(r["memory"].get("peak"))),
        ("live at the peak (GB)", lambda r: _gb(r["peak"]["bytes"])),
        ("  arguments (state, batch)", lambda r: _gb(r["peak"]["by_origin"].get("argument"))),
        ("  buffers allocated ahead (AllocateBuffer)",
         lambda r: _gb(r["peak"]["by_origin"].get("AllocateBuffer", 0))),
        ("HBM bytes, loop trips counted (GB)", lambda r: _gb(r["counted"]["bytes accessed"])),
        ("  of them in HBM: VMEM accesses left out (GB)", lambda r: _gb(r.get("hbm_bytes"))),
        ("HBM bytes, compiler's count: loop bodies once (GB)",
         lambda r: _gb(r["compiler_cost"].get("bytes accessed"))),
        ("FLOPs, loop trips counted (TFLOP)", lambda r: f"{r['counted']['flops'] / 1e12:.2f}"),
        ("FLOPs, compiler's count (TFLOP)",
         lambda r: f"{r['compiler_cost'].get('flops', 0) / 1e12:.2f}"),
        ("collectives written (GB)", lambda r: _gb(sum(r["collective_bytes"].values()))),
        ("collectives, least sent (GB)", lambda r: _gb(r["collective_sent"])),
        ("  and between slices, over DCN (GB)", lambda r: _gb(r.get("dcn_sent"))),
        ("planner: roofline (ms)", lambda r: f"{r['estimate']['roofline_s'] * 1e3:.0f} "
                                             f"({r['estimate']['bound']})"),
        ("planner: HBM bound, HBM-only bytes (ms)",
         lambda r: f"{r['estimate']['memory_s'] * 1e3:.0f}"),
        ("planner: interconnect bound (ms)",
         lambda r: f"{(r['estimate']['interconnect_s'] or 0) * 1e3:.0f}"))


def _overlapped(row: dict, kind: str) -> str:
    """A kind of collective's bytes the schedule overlaps with compute, leaves exposed and runs
    synchronously (``jaxaccel.plan.overlap``); "-" where the side has none of that kind."""
    got = (row.get("collective_overlap") or {}).get(kind)
    if not got or not got["bytes"]:
        return "-"
    return " / ".join(_gb(got[k]) for k in ("overlapped", "exposed", "synchronous"))


def _gb(x) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def table(rows: list[dict]) -> str:
    """Metrics down, sides across (per chip); after the collectives, each kind's bytes by how
    the schedule runs them (``_overlapped``)."""
    lines = ["| per chip | " + " | ".join(r["name"] + (" (earlier run)" if r.get("reused")
                                                      else "") for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    kinds = {k: None for r in rows for k, v in (r.get("collective_overlap") or {}).items()
             if v["bytes"]}
    overlap_rows = [(f"  {kind}: overlapped / exposed / synchronous (GB)",
                     lambda r, kind=kind: _overlapped(r, kind)) for kind in kinds]
    at = 1 + next(k for k, (label, _) in enumerate(ROWS) if "over DCN" in label)
    lines += [f"| {label} | " + " | ".join(get(r) for r in rows) + " |"
              for label, get in (*ROWS[:at], *overlap_rows, *ROWS[at:])]
    return "\n".join(lines)


def by_op(parts: list, top: int = 40) -> list[dict]:
    """The step's HBM bytes and FLOPs by jax operation: each instruction costed alone
    (``parts``: ``hlo_cost.by_instruction``'s) times its runs, grouped by the pass it belongs
    to (forward, backward, the backward's remat forward), the last part of its ``op_name`` and
    the dtype of its result."""
    groups = {}
    for i, _, runs, cost in parts:
        op = _OP_NAME.search(i.attributes)
        op = op.group(1) if op else ""
        stage = ("backward" if "transpose(" in op else "forward" if op else "-") + \
            (" (remat)" if "rematted" in op else "")
        dtype = re.match(r"\(?(\w+)\[", i.shape)
        key = (stage, re.sub(r"\[.*", "", op.split("/")[-1]) if op else i.opcode,
               dtype.group(1) if dtype else "")
        g = groups.setdefault(key, {"pass": key[0], "op": key[1], "dtype": key[2],
                                    "bytes": 0.0, "flops": 0.0})
        g["bytes"] += runs * cost["bytes accessed"]
        g["flops"] += runs * cost["flops"]
    return sorted(groups.values(), key=lambda g: -g["bytes"])[:top]


def peaks(rows: list[dict]) -> str:
    """Each side's largest groups of values live at its peak (``count x shape``, origin), and
    where its HBM bytes go (``--by-op``)."""
    lines = []
    for r in rows:
        lines.append(f"{r['name']}: live at the peak {_gb(r['peak']['bytes'])} GB")
        lines += [f"  {g['bytes'] / 2 ** 20:8.1f} MiB  {g['count']:3d} x {g['shape'][:70]}  "
                  f"({g['origin']}) {g['op_name'][-60:]}" for g in r["peak"]["largest"]]
        if r.get("by_op"):
            lines.append(f"{r['name']}: HBM bytes by jax operation (pass, op, result dtype)")
            lines += [f"  {g['bytes'] / 1e9:7.1f} GB  {g['pass']}: {g['op']} ({g['dtype']})"
                      for g in r["by_op"][:20]]
    return "\n".join(lines)


def commands(argv: list[str]) -> list[str]:
    """The two commands that rerun this comparison from a checkout."""
    return ["pip install -e '.[aot]'", "python bench/maxtext_step.py " + " ".join(argv)]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-1b", help="a Llama preset (models/spec.py)")
    p.add_argument("--topology", default="v5e-8", help="a Cloud TPU slice name (v5e-8, v6e-8; "
                                                        "2xv5e-256: two slices)")
    p.add_argument("--mesh", default="fsdp=8",
                   help="data=N,fsdp=M,tensor=T (their product: the chips; tensor: Megatron "
                        "heads and MLP), dcn_data=K or dcn_fsdp=K across slices")
    p.add_argument("--batch", type=int, default=32, help="global batch (rows)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per row")
    p.add_argument("--sides", default=",".join(SIDES), help=f"any of {','.join(SIDES)}")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="more of our config's settings (e.g. a scanned model's)")
    p.add_argument("--reuse", action="store_true",
                   help="analyse a side compiled before (its --work folder) instead of "
                        "compiling it again")
    p.add_argument("--by-op", action="store_true",
                   help="also the HBM bytes by jax operation (each instruction costed alone: "
                        "minutes per side)")
    p.add_argument("--work", help="where each side's HLO and XLA dumps go (default: the cache "
                                  "folder, maxtext-bench/<model>-<topology>-<mesh>)")
    p.add_argument("--python", help="a Python 3.12 for MaxText's environment")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join("runs", "bench"), metavar="DIR",
                   help="folder for the result JSON (bench/results only on purpose)")
    a = p.parse_args(argv)
    a.work = a.work or os.path.join(cache_dir(), "maxtext-bench",
                                    f"{a.model}-{a.topology}-{a.mesh.replace(',', '-')}"
                                    .replace("=", ""))
    if os.environ.get(IN_VENV) != "1":
        python = ensure_maxtext_venv(a.python)
        env = {**os.environ, IN_VENV: "1", "JAX_PLATFORMS": "cpu",
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        os.execve(python, [python, os.path.abspath(__file__), *argv], env)
    if a.child:
        compile_side(a.child, a)
        return
    sides = [s for s in a.sides.split(",") if s]
    reused = [s for s in sides
              if a.reuse and os.path.exists(os.path.join(a.work, name(s, a), "side.json"))]
    for side in sides:
        if side not in reused:
            subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--child", side],
                           check=True)
    report(a, argv, sides, reused)


def report(a, argv: list[str], sides: list[str], reused: list[str]) -> None:
    """Analyse the sides, check their parameter counts equal, write the JSON and print the
    table; a side in ``reused`` (``--reuse``) is marked ``"reused": true``: compiled in an
    earlier run, its compile seconds, date and load are that run's (``side.json``'s)."""
    import importlib.metadata

    import jax

    from bench.common import git_sha
    target, cfg, spec = setting(a)
    rows = [{**analyse(side, a, target, cfg, spec), "reused": side in reused} for side in sides]
    if len({r["parameters"] for r in rows}) > 1:
        raise SystemExit("the sides count different parameters: " + ", ".join(
            f"{r['name']} {r['parameters']:,}" for r in rows))
    result = {"bench": "maxtext", "device": target.device_kind, "topology": a.topology,
              "model": a.model, "batch": a.batch, "seq": a.seq, "mesh": a.mesh,
              "maxtext": MAXTEXT, "jax": jax.__version__,
              "libtpu": importlib.metadata.version("libtpu"), "jaxaccel": git_sha(),
              "date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg(),
              "ours": cfg.to_dict(), "maxtext_args": maxtext_args(cfg, spec, target,
                                                                   a.topology, scan=True),
              "commands": commands([x for x in argv if x != "--reuse"]), "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, result_name(a, sides))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(table(rows) + "\n\n" + peaks(rows))
    print(f"\n{path}\nrerun: " + "\n       ".join(result["commands"]))


if __name__ == "__main__":
    main()
