"""bench/maxtext_step.py without MaxText: its settings are derived from our resolved config
(shapes, batch per chip, dtypes, remat, attention, mesh, AdamW), and the largest temporaries
are read back from XLA's memory-usage report."""
import sys
from types import SimpleNamespace

import pytest
from support import ROOT, needs_libtpu

sys.path.insert(0, ROOT)
from bench import maxtext_step  # noqa: E402


def args_of(model, mesh, *ours, topology="v5e-8"):
    a = SimpleNamespace(model=model, topology=topology, mesh=mesh, batch=32, seq=2048,
                        ours_set=list(ours))
    target, cfg, spec = maxtext_step.setting(a)
    return dict(kv.split("=", 1) for kv in maxtext_step.maxtext_args(
        cfg, spec, target, a.topology, scan=True))


@needs_libtpu
def test_maxtext_gets_our_model_batch_mesh_and_dtypes():
    got = args_of("llama-1b", "fsdp=8")
    assert {k: got[k] for k in ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads",
                                "base_mlp_dim", "base_num_decoder_layers", "head_dim",
                                "vocab_size", "logits_via_embedding")} == {
        "base_emb_dim": "2048", "base_num_query_heads": "32", "base_num_kv_heads": "4",
        "base_mlp_dim": "5632", "base_num_decoder_layers": "22", "head_dim": "64",
        "vocab_size": "32000", "logits_via_embedding": "false"}
    assert (got["per_device_batch_size"], got["max_target_length"]) == ("4.0", "2048")
    assert (got["dtype"], got["weight_dtype"]) == ("bfloat16", "float32")
    assert (got["remat_policy"], got["attention"], got["scan_layers"]) == ("full", "flash",
                                                                           "true")
    assert (got["ici_data_parallelism"], got["ici_fsdp_parallelism"],
            got["ici_tensor_parallelism"]) == ("1", "8", "1")
    # AdamW as our config has it (the decoder job's b2 0.95, weight decay 0.1).
    assert (got["adam_b2"], got["adam_weight_decay"]) == ("0.95", "0.1")
    tied = args_of("llama-350m", "data=2,fsdp=4", "model.remat=false")
    assert tied["logits_via_embedding"] == "true" and tied["remat_policy"] == "none"
    assert (tied["ici_data_parallelism"], tied["ici_fsdp_parallelism"]) == ("2", "4")
    # MaxText's Llama-2 70B v5p recipe's policy, by its name.
    mlpwi = args_of("llama-1b", "fsdp=8", "model.remat=save_dot_except_mlpwi")
    assert mlpwi["remat_policy"] == "save_dot_except_mlpwi"
    # Two slices, data parallel between them: MaxText's ICI and DCN sizes, one slice's topology.
    two = args_of("llama-1b", "data=2,fsdp=8,dcn_data=2", topology="2xv5e-8")
    assert {k: two[k] for k in ("ici_data_parallelism", "ici_fsdp_parallelism",
                                "dcn_data_parallelism", "dcn_fsdp_parallelism",
                                "compile_topology", "compile_topology_num_slices",
                                "per_device_batch_size")} == {
        "ici_data_parallelism": "1", "ici_fsdp_parallelism": "8", "dcn_data_parallelism": "2",
        "dcn_fsdp_parallelism": "1", "compile_topology": "v5e-8",
        "compile_topology_num_slices": "2", "per_device_batch_size": "2.0"}


def test_the_mesh_flag_names_its_axes_and_sizes():
    assert maxtext_step.mesh_of("fsdp=32,tensor=4") == {"fsdp": 32, "tensor": 4}
    assert maxtext_step.mesh_of("data=2,fsdp=256,dcn_data=2") == {
        "data": 2, "fsdp": 256, "dcn_data": 2}
    for wrong in ("fsdp=32,model=4", "fsdp=32,tensor", "tensor=four", "stage=2"):
        with pytest.raises(SystemExit, match="AXIS=N with AXIS one of data, fsdp, tensor"):
            maxtext_step.mesh_of(wrong)


@needs_libtpu
def test_fsdp_x_tensor_reaches_both_sides():
    """``--mesh fsdp=4,tensor=2``: ours ``mesh.tensor=2``, MaxText ``ici_tensor_parallelism=2``,
    the batch per chip still the global batch over all the chips (MaxText's meaning)."""
    a = SimpleNamespace(model="llama-1b", topology="v5e-8", mesh="fsdp=4,tensor=2", batch=32,
                        seq=2048, ours_set=[])
    target, cfg, spec = maxtext_step.setting(a)
    assert {k: cfg.mesh[k] for k in maxtext_step.MESH} == {
        "data": 1, "fsdp": 4, "tensor": 2, "dcn_data": 1, "dcn_fsdp": 1}
    got = dict(kv.split("=", 1) for kv in maxtext_step.maxtext_args(
        cfg, spec, target, a.topology, scan=True))
    assert {k: got[k] for k in ("ici_data_parallelism", "ici_fsdp_parallelism",
                                "ici_tensor_parallelism", "dcn_data_parallelism",
                                "dcn_fsdp_parallelism", "per_device_batch_size")} == {
        "ici_data_parallelism": "1", "ici_fsdp_parallelism": "4", "ici_tensor_parallelism": "2",
        "dcn_data_parallelism": "1", "dcn_fsdp_parallelism": "1", "per_device_batch_size": "4.0"}
    assert maxtext_step.result_name(a, list(maxtext_step.SIDES)) == \
        "maxtext-llama-1b-v5e-8-fsdp4-tensor2.json"


def test_the_largest_temporaries_come_from_the_memory_usage_report(tmp_path):
    """Read from a side's dump folder, whose name may hold brackets (``--ours-set``'s)."""
    tmp_path = tmp_path / "jaxaccel[train.loss_chunks=8]"
    tmp_path.mkdir()
    (tmp_path / "module_0000.jit_step.cl_1.after_optimizations-memory-usage-report.txt"
     ).write_text("""Memory Space: default (color=0)
Total bytes: 4604925440 (4.29GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
  704.00MiB( 16%);  704.00MiB;     97058816;                5; 5×bf16[22,4,2048,2048]
    1.18GiB( 28%);  500.00MiB;   1268187136;                1; bf16[4,2048,32000]
    1.66GiB( 39%);    8.00KiB;   1792475136;                2; f32[2048], u32[]
  The rest 719 values are less than 5% of the total size and not shown.

  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
  121.00MiB(100%);  121.00MiB;            0;                2; 2×f32[256,22,5632]
""")
    assert maxtext_step.largest_temporaries(str(tmp_path), top=2) == [
        {"bytes": 704 * 2 ** 20, "values": "5×bf16[22,4,2048,2048]"},
        {"bytes": 500 * 2 ** 20, "values": "bf16[4,2048,32000]"}]
    assert maxtext_step._bytes("1.50GiB") == 3 * 2 ** 29


def test_a_variant_of_one_side_does_not_overwrite_the_comparison():
    """The result file names the sides that ran and our settings, so rerunning our side with
    ``--ours-set`` leaves the side-by-side file as it was (issue 58 lost one that way)."""
    a = SimpleNamespace(model="llama3-8b", topology="v5p-32", mesh="fsdp=16", ours_set=[])
    both = maxtext_step.result_name(a, list(maxtext_step.SIDES))
    assert both == "maxtext-llama3-8b-v5p-32-fsdp16.json"
    a.ours_set = ["train.loss_chunks=8"]
    assert maxtext_step.result_name(a, ["jaxaccel"]) == \
        "maxtext-llama3-8b-v5p-32-fsdp16-jaxaccel-loss_chunks8.json"
