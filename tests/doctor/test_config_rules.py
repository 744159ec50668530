"""Each config rule: one setup that triggers it and one that doesn't, read from real config files."""
import json

import yaml

from shardfit.doctor.diagnose import diagnose
from shardfit.doctor.rules import Context
from shardfit.spec.gpus import get_gpu
from shardfit.spec.models import load_model_spec

H100 = get_gpu("H100-80GB")
L8B = load_model_spec("llama-3.1-8b")
L70B = load_model_spec("llama-3.1-70b")


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if name.endswith((".yaml", ".yml")) else json.dumps(data))
    return str(path)


def rules(paths, **ctx):
    report = diagnose(paths if isinstance(paths, list) else [paths], Context(**ctx))
    return {f.rule: f for f in report.findings}


def ds(stage=2, micro=1, accum=1, batch=None, precision="bf16", offload=None, nvme=False, **zero):
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accum,
              precision: {"enabled": True} if precision != "fp32" else None,
              "zero_optimization": {"stage": stage, **zero}}
    config = {k: v for k, v in config.items() if v is not None}
    if batch:
        config["train_batch_size"] = batch
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "nvme" if nvme else "cpu", "nvme_path": "/nvme"}
        if stage == 3:
            config["zero_optimization"]["offload_param"] = {"device": "nvme" if nvme else "cpu", "nvme_path": "/nvme"}
    return config


def accel_fsdp(version=1, wrap="TRANSFORMER_BASED_WRAP", sharding="FULL_SHARD", ac=False, machines=1, processes=8,
               state="SHARDED_STATE_DICT", precision="bf16"):
    fsdp = {"fsdp_version": version, "fsdp_activation_checkpointing": ac, "fsdp_state_dict_type": state}
    if wrap:
        fsdp["fsdp_auto_wrap_policy"] = wrap
    if version == 1:
        fsdp["fsdp_sharding_strategy"] = sharding
    return {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "mixed_precision": precision,
            "num_machines": machines, "num_processes": processes, "fsdp_config": fsdp}


def test_fsdp_without_auto_wrap(tmp_path):
    assert "fsdp-no-auto-wrap" in rules(write(tmp_path, "a.yaml", accel_fsdp(wrap=None)))
    assert "fsdp-no-auto-wrap" in rules(write(tmp_path, "b.yaml", accel_fsdp(wrap="NO_WRAP")))
    assert "fsdp-no-auto-wrap" not in rules(write(tmp_path, "c.yaml", accel_fsdp()))


def test_fp16_without_loss_scaling(tmp_path):
    bad = ds(precision="fp16")
    bad["fp16"]["loss_scale"] = 1  # a static scale of 1: no scaling at all
    finding = rules(write(tmp_path, "bad.json", bad))["fp16-no-loss-scaling"]
    assert finding.severity == "error" and finding.where.endswith("bad.json")
    assert "fp16-no-loss-scaling" not in rules(write(tmp_path, "ok.json", ds(precision="fp16")))  # 0 = dynamic


def test_fp16_where_bf16_is_supported(tmp_path):
    path = write(tmp_path, "ds.json", ds(precision="fp16"))
    assert "fp16-where-bf16" in rules(path, gpu=H100)
    assert "fp16-where-bf16" not in rules(path, gpu=get_gpu("V100-32GB"))  # no bf16 there: fp16 is right


def test_no_activation_checkpointing_with_long_sequences(tmp_path):
    no_ac = write(tmp_path, "no_ac.yaml", accel_fsdp())
    with_ac = write(tmp_path, "ac.yaml", accel_fsdp(ac=True))
    # Without sizes: a warning from the sequence length alone.
    assert rules(no_ac, seq_len=8192)["no-ac-long-seq"].severity == "warning"
    assert "no-ac-long-seq" not in rules(no_ac, seq_len=1024)
    assert "no-ac-long-seq" not in rules(with_ac, seq_len=8192)
    # With sizes: an error when the estimator says it only fits with checkpointing.
    finding = rules(no_ac, seq_len=8192, model=L8B, gpu=H100, gpus_per_node=8)["no-ac-long-seq"]
    assert finding.severity == "error" and "GiB with checkpointing" in finding.message


def test_bucket_too_large(tmp_path):
    huge = write(tmp_path, "huge.json", ds(stage=2, reduce_bucket_size=5e8, allgather_bucket_size=5e8))
    small = write(tmp_path, "small.json", ds(stage=2, reduce_bucket_size=5e7, allgather_bucket_size=5e7))
    assert "bucket-too-large" in rules(huge, gpu=get_gpu("T4"))  # 2 GB of buffers on a 15 GiB card
    assert "bucket-too-large" in rules(huge, model=load_model_spec("tiny-llama"))  # bigger than the model
    assert "bucket-too-large" not in rules(huge, gpu=H100, model=L8B)
    assert "bucket-too-large" not in rules(small, gpu=get_gpu("T4"))


def test_zero3_where_zero2_fits(tmp_path):
    path = write(tmp_path, "z3.json", ds(stage=3))
    finding = rules(path, model=L8B, gpu=H100, gpus_per_node=8)["zero3-where-zero2-fits"]
    assert "stage 2" in finding.fix
    assert "zero3-where-zero2-fits" not in rules(path, model=L70B, gpu=H100, gpus_per_node=8)
    assert "zero3-where-zero2-fits" not in rules(path)  # sizes unknown: stay quiet
    # A plan names its model and GPU itself.
    plan = {"model": "llama-3.1-8b", "strategy": {"kind": "zero3"}, "training": {"seq_len": 2048},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "H100-80GB"}}
    assert "zero3-where-zero2-fits" in rules(write(tmp_path, "plan.yaml", plan))


def test_offload_not_needed(tmp_path):
    path = write(tmp_path, "off.json", ds(stage=3, offload=True))
    assert "offload-not-needed" in rules(path, model=L8B, gpu=H100, gpus_per_node=8)
    assert "offload-not-needed" not in rules(path, model=L70B, gpu=get_gpu("A100-40GB"), gpus_per_node=8)


def test_full_shard_across_nodes_on_slow_links(tmp_path):
    multi = write(tmp_path, "multi.yaml", accel_fsdp(machines=4, processes=32))
    hybrid = write(tmp_path, "hybrid.yaml", accel_fsdp(machines=4, processes=32, sharding="HYBRID_SHARD"))
    finding = rules(multi, gpu=H100)["full-shard-slow-links"]
    assert finding.severity == "warning" and "HYBRID_SHARD" in finding.fix
    assert "full-shard-slow-links" not in rules(hybrid, gpu=H100)
    assert "full-shard-slow-links" not in rules(write(tmp_path, "one.yaml", accel_fsdp()), gpu=H100)
    # One node without NVLink: the all-gathers cross PCIe.
    pcie = rules(write(tmp_path, "pcie.yaml", accel_fsdp()), gpu=get_gpu("L40S"))["full-shard-slow-links"]
    assert "no NVLink" in pcie.message and "SHARD_GRAD_OP" in pcie.fix


def test_full_state_dict_on_rank0(tmp_path):
    hf = {"output_dir": "out", "per_device_train_batch_size": 1, "fsdp": True,
          "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}  # HF's default: FULL_STATE_DICT
    path = write(tmp_path, "args.json", hf)
    # 70B in fp32 is 261 GiB gathered into rank 0's host RAM: beyond a 256 GiB host, a cost on a bigger one.
    assert rules(path, model=L70B, gpu=H100, host_memory_gib=256)["full-state-dict-rank0"].severity == "error"
    assert rules(path, model=L70B, gpu=H100)["full-state-dict-rank0"].severity == "warning"
    assert "full-state-dict-rank0" not in rules(path, model=load_model_spec("llama-1b"), gpu=H100)
    hf["fsdp_config"]["state_dict_type"] = "SHARDED_STATE_DICT"
    assert "full-state-dict-rank0" not in rules(write(tmp_path, "sharded.json", hf), model=L70B, gpu=H100)


def test_batch_mismatch(tmp_path):
    bad = rules(write(tmp_path, "bad.json", ds(micro=2, accum=4, batch=128)), gpus_per_node=8)["batch-mismatch"]
    assert "2 x accumulation 4 x 8 GPUs = 64" in bad.message and "accumulation to 8" in bad.fix
    assert "batch-mismatch" not in rules(write(tmp_path, "ok.json", ds(micro=2, accum=8, batch=128)), gpus_per_node=8)
    # The world size can come from the accelerate file next to the DeepSpeed JSON.
    accel = write(tmp_path, "acc.yaml", {"distributed_type": "DEEPSPEED", "num_processes": 16, "num_machines": 2,
                                         "mixed_precision": "bf16", "deepspeed_config": {"deepspeed_config_file": "ok.json"}})
    assert "batch-mismatch" in rules([accel], global_batch=128)


def test_fsdp1_hybrid_with_shard_group_of_one(tmp_path):
    bad = accel_fsdp(sharding="HYBRID_SHARD", machines=2, processes=2)  # one GPU per node: groups of 1
    assert rules(write(tmp_path, "bad.yaml", bad))["fsdp1-hybrid-group-1"].severity == "error"
    ok = accel_fsdp(sharding="HYBRID_SHARD", machines=2, processes=16)
    assert "fsdp1-hybrid-group-1" not in rules(write(tmp_path, "ok.yaml", ok))
    plan = {"model": "tiny-llama", "strategy": {"kind": "fsdp", "sharding": "hybrid_shard", "shard_group_size": 1},
            "cluster": {"nodes": 2, "gpus_per_node": 1}}
    assert "fsdp1-hybrid-group-1" in rules(write(tmp_path, "plan.yaml", plan))


def test_zero12_nvme_offload(tmp_path):
    assert "zero12-nvme-offload" in rules(write(tmp_path, "z2.json", ds(stage=2, offload=True, nvme=True)))
    assert "zero12-nvme-offload" not in rules(write(tmp_path, "z3.json", ds(stage=3, offload=True, nvme=True)))
    assert "zero12-nvme-offload" not in rules(write(tmp_path, "cpu.json", ds(stage=2, offload=True)))


def test_a_clean_plan_has_no_errors(tmp_path):
    plan = {"model": "llama-3.1-8b", "strategy": {"kind": "zero2"},
            "training": {"micro_batch": 1, "seq_len": 2048, "activation_checkpointing": "full"},
            "cluster": {"nodes": 1, "gpus_per_node": 8, "gpu": "H100-80GB"}}
    report = diagnose([write(tmp_path, "plan.yaml", plan)], Context(gpu=H100))
    assert report.files[0][1] == "plan" and report.errors == 0


# The two DeepSpeed configs of the Polish seed article ("DeepSpeed czy FSDP w PyTorch"), verbatim.
ARTICLE_ZERO2 = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                       "reduce_scatter": True},
                 "gradient_clipping": 1.0, "steps_per_print": 100}
ARTICLE_ZERO3 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 16, "bf16": {"enabled": True},
                 "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                       "reduce_scatter": True, "allgather_partitions": True,
                                       "allgather_bucket_size": 200000000, "reduce_bucket_size": 200000000}}


def test_the_seed_articles_deepspeed_configs(tmp_path):
    z2 = write(tmp_path, "zero2.json", ARTICLE_ZERO2)
    z3 = write(tmp_path, "zero3.json", ARTICLE_ZERO3)
    assert rules(z2, model=L8B, gpu=H100, gpus_per_node=8, seq_len=2048) == {}
    # The same config for a 70B model does not fit at all.
    assert rules(z2, model=L70B, gpu=H100, gpus_per_node=8, seq_len=2048)["does-not-fit"].severity == "error"
    # "If ZeRO-2 solves the memory problem, ZeRO-3 only adds communication": for an 8B model on 8 H100s it does.
    assert "zero3-where-zero2-fits" in rules(z3, model=L8B, gpu=H100, gpus_per_node=8, seq_len=2048)
    assert "zero3-where-zero2-fits" not in rules(z3, model=L70B, gpu=H100, gpus_per_node=8, seq_len=2048)


def test_use_cache_in_the_model_config_with_checkpointing(tmp_path):
    config = write(tmp_path, "config.json", {"model_type": "llama", "use_cache": True})
    args = write(tmp_path, "args.json", {"output_dir": "out", "per_device_train_batch_size": 1,
                                         "gradient_checkpointing": True})
    assert rules([args, config])["use-cache-with-checkpointing"].where.endswith("config.json")
    off = write(tmp_path, "off.json", {"model_type": "llama", "use_cache": False})
    assert "use-cache-with-checkpointing" not in rules([args, off])
    no_ac = write(tmp_path, "no_ac.json", {"output_dir": "out", "per_device_train_batch_size": 1})
    assert "use-cache-with-checkpointing" not in rules([no_ac, config])


def test_a_key_written_twice_in_a_config_is_one_error_line(tmp_path, capsys):
    from shardfit.cli import main

    path = tmp_path / "ds_config.json"
    path.write_text('{\n  "train_micro_batch_size_per_gpu": 4,\n  "zero_optimization": {\n    "stage": 2,\n'
                    '    "overlap_comm": true,\n    "stage": 3\n  }\n}\n')
    accel = tmp_path / "accelerate.yaml"
    accel.write_text("distributed_type: FSDP\nnum_processes: 8\nnum_processes: 16\n")
    for config, line, first, key in ((path, 6, 4, "stage"), (accel, 3, 2, "num_processes")):
        assert main(["doctor", str(config)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"shardfit: error: {config} line {line}: duplicate key '{key}' (also at line {first}): keep one"]


def test_one_process_configs_are_read_as_single(tmp_path):
    from shardfit.doctor.rules import plan_of
    from shardfit.doctor.setup import read_setup
    from shardfit.emit import emit
    from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

    seven = load_model_spec("llama-2-7b")
    plan = Plan(model=seven, strategy=parse_strategy("single"), cluster=Cluster(nodes=1, gpus_per_node=1),
                training=Training(micro_batch=1, seq_len=2048, activation_checkpointing="full"))
    accel = tmp_path / "accelerate.yaml"
    accel.write_text(emit(plan, "accelerate").main)
    setup, _ = read_setup([str(accel)])
    assert setup.engine == "single"
    assert plan_of(setup, Context(model=seven, gpu=H100, seq_len=2048)).strategy.kind == "single"
    found = rules(str(accel), model=seven, gpu=H100, seq_len=2048)
    # 16 B/param of a 7B model on one GPU: the finding names the strategy the config really runs.
    assert "single" in found["does-not-fit"].message and "--gpus 1" in found["does-not-fit"].fix
    multi = write(tmp_path, "multi.yaml", {"distributed_type": "MULTI_GPU", "num_processes": 2, "num_machines": 1})
    assert read_setup([multi])[0].engine == "ddp"
    small = {"model": "llama-1b", "strategy": {"kind": "single"},
             "training": {"micro_batch": 1, "seq_len": 2048, "activation_checkpointing": "full"},
             "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu": "H100-80GB"}}
    report = diagnose([write(tmp_path, "plan.yaml", small)], Context(gpu=H100))
    assert report.errors == 0


# HF's ds_config templates (transformers docs, "DeepSpeed"): everything the Trainer knows is "auto".
HF_AUTO_ZERO3 = {"fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
                 "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": "auto",
                                       "stage3_prefetch_bucket_size": "auto",
                                       "stage3_gather_16bit_weights_on_model_save": True},
                 "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
                 "train_micro_batch_size_per_gpu": "auto"}


def test_auto_values_are_resolved_from_flags_or_said_to_be_assumed(tmp_path):
    path = write(tmp_path, "ds_config.json", HF_AUTO_ZERO3)
    report = diagnose([path], Context())
    assert report.setup.precision is None  # "auto" is not fp32
    assert set(report.setup.auto) == {"precision", "micro_batch", "grad_accum", "global_batch"}
    assert "auto-values" in {f.rule for f in report.findings}  # never "no findings"
    assert any(line.startswith('precision is "auto"') and "assumed bf16; give --precision" in line
               for line in report.assumed)
    # The flags fill them in; what was taken from a flag is said, and the rules use it.
    ctx = Context(model=L70B, gpu=H100, gpus_per_node=8, seq_len=4096)
    flags = {"precision": "bf16", "micro_batch": 8, "grad_accum": 2, "global_batch": 128,
             "activation_checkpointing": False}
    report = diagnose([path], ctx, flags)
    assert report.setup.micro_batch == 8 and report.setup.precision == "bf16" and not report.setup.auto
    assert 'micro batch 8 from --micro-batch ("auto" in the configs)' in report.assumed
    found = {f.rule: f for f in report.findings}
    assert "auto-values" not in found
    assert "micro-batch 8" in found["does-not-fit"].message and "AC none" in found["does-not-fit"].message


def test_auto_in_the_ds_config_and_a_value_in_the_trainer_args(tmp_path):
    ds_path = write(tmp_path, "ds_config.json", HF_AUTO_ZERO3)
    args = write(tmp_path, "args.json", {"output_dir": "out", "per_device_train_batch_size": 4, "bf16": True,
                                         "gradient_accumulation_steps": 2, "deepspeed": ds_path})
    report = diagnose([args], Context())
    assert report.setup.micro_batch == 4 and report.setup.precision == "bf16"
    assert report.setup.auto == ("global_batch",)


def test_full_state_dict_names_rank0_host_ram(tmp_path):
    path = write(tmp_path, "ds_config.json", HF_AUTO_ZERO3)
    small_host = rules(path, model=L70B, gpu=H100, gpus_per_node=8, host_memory_gib=128)["full-state-dict-rank0"]
    assert small_host.severity == "error" and "rank 0's host RAM" in small_host.message
    assert "128 GiB (--host-memory-gib)" in small_host.message
    assumed = rules(path, model=L70B, gpu=H100, gpus_per_node=8)["full-state-dict-rank0"]
    assert assumed.severity == "warning" and "assumed for 8 x H100-80GB" in assumed.message
