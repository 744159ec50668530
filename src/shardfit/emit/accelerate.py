"""Accelerate config YAML (`accelerate launch --config_file ...`) from a Plan.

Keys are the ones `accelerate config` writes and `accelerate launch` reads (ClusterConfig plus the
`--fsdp_*` / DeepSpeed launch arguments); tests load the file with accelerate's own loader.
"""
from __future__ import annotations

import yaml

from shardfit.emit.common import Emitted, EmitOptions, ac_every, block_class
from shardfit.emit.kernels import optimizer_line, trainer_kernel_notes
from shardfit.errors import ShardfitError
from shardfit.spec.parallelism import resolve
from shardfit.spec.plan import Plan

_MIXED = {"bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16", "fp32": "no"}
_FSDP1_SHARDING = {"full_shard": "FULL_SHARD", "shard_grad_op": "SHARD_GRAD_OP", "hybrid_shard": "HYBRID_SHARD",
                   "no_shard": "NO_SHARD"}


def accelerate_config(plan: Plan, options: EmitOptions) -> tuple[dict, list[str]]:
    s, t, c = plan.strategy, plan.training, plan.cluster
    notes: list[str] = []
    if not plan.parallelism.is_default and s.kind != "fsdp2":
        raise ShardfitError(f"accelerate composes tp / cp with FSDP2 only (its ParallelismConfig), not {s.label}: "
                            "use strategy fsdp2")
    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": _MIXED[t.precision],
        "num_machines": c.nodes,
        "num_processes": c.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
        "downcast_bf16": "no",
    }
    if c.nodes > 1:
        config["main_process_ip"] = options.master_addr if not options.master_addr.startswith("$") else "node-0"
        config["main_process_port"] = options.master_port
        notes.append("set main_process_ip to the first node's address and machine_rank per node")
    if s.is_deepspeed:
        config["distributed_type"] = "DEEPSPEED"
        ds = {"zero_stage": int(s.kind[-1]), "gradient_accumulation_steps": t.grad_accum,
              "gradient_clipping": plan.schedule.grad_clip,
              "offload_optimizer_device": s.offload_optimizer or "none",
              "offload_param_device": s.offload_params or "none"}
        if s.offload_optimizer == "nvme":
            ds["offload_optimizer_nvme_path"] = s.nvme_path
        if s.offload_params == "nvme":
            ds["offload_param_nvme_path"] = s.nvme_path
        if s.kind == "zero3":
            ds["zero3_init_flag"] = True
            ds["zero3_save_16bit_model"] = False
        if c.nodes > 1:
            ds["deepspeed_multinode_launcher"] = "standard"
        config["deepspeed_config"] = ds
        notes.append("bucket sizes are not accelerate arguments: for non-default buckets pass the JSON from "
                     "`shardfit emit --format deepspeed` as deepspeed_config_file")
    elif s.kind in ("fsdp", "fsdp2"):
        config["distributed_type"] = "FSDP"
        every = ac_every(plan)
        fsdp = {"fsdp_version": 1 if s.kind == "fsdp" else 2,
                "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                "fsdp_transformer_layer_cls_to_wrap": s.wrap_unit or block_class(plan.model),
                "fsdp_offload_params": bool(s.offload_params),
                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                # rank 0 reads the weights, the others build on the meta device
                "fsdp_cpu_ram_efficient_loading": True,
                "fsdp_activation_checkpointing": every > 0}
        if every > 1:
            notes.append(f"accelerate checkpoints every block: the plan's {t.activation_checkpointing} becomes full")
        if s.kind == "fsdp":
            # FSDP1 only: FSDP2 dropped both (it always keeps the original parameters, and its
            # cpu_ram_efficient_loading broadcasts the state dict instead of syncing module states).
            fsdp["fsdp_sync_module_states"] = True
            fsdp["fsdp_use_orig_params"] = True
            fsdp["fsdp_sharding_strategy"] = _FSDP1_SHARDING[s.sharding]
            fsdp["fsdp_backward_prefetch"] = {"backward_pre": "BACKWARD_PRE", "backward_post": "BACKWARD_POST",
                                              "none": "NO_PREFETCH"}[s.backward_prefetch]
        else:
            fsdp["fsdp_reshard_after_forward"] = s.reshard_after_forward
            group = s.shard_group(c.gpus_per_node)
            if not plan.parallelism.is_default:
                config["parallelism_config"], more = _parallelism_config(plan)
                notes += more
            elif group and group < c.world_size:
                # FSDP2 hybrid sharding (HSDP) is a 2-D mesh: replicate across groups, shard inside.
                config["parallelism_config"] = {"parallelism_config_dp_replicate_size": c.world_size // group,
                                                "parallelism_config_dp_shard_size": group}
        config["fsdp_config"] = fsdp
    elif s.kind == "single":
        # One process on one device: accelerate prepares the model without any wrapper.
        config["distributed_type"] = "NO"
        config["gpu_ids"] = "all"  # the first visible GPU; "0" would override a scheduler's CUDA_VISIBLE_DEVICES
    else:
        config["distributed_type"] = "MULTI_GPU" if c.world_size > 1 else "NO"
        if c.nodes == 1:
            config["gpu_ids"] = "all"
    return config, notes


def _parallelism_config(plan: Plan) -> tuple[dict, list[str]]:
    """accelerate's ParallelismConfig (`accelerate launch --parallelism_config_*`): dp_replicate x dp_shard x
    tp x cp ranks, the 2-D..4-D DeviceMesh accelerate builds for FSDP2. It has no pipeline dimension, and
    its `sp` is DeepSpeed's Ulysses, not TP's sequence parallel."""
    layout = resolve(plan)
    if layout.pp > 1:
        raise ShardfitError(f"accelerate's ParallelismConfig has no pipeline dimension and this plan has pp={layout.pp}: "
                            f"run it with torchtitan or Megatron-LM (`--pp {layout.pp}`), or fit without pipeline stages")
    if layout.ep > 1:
        raise ShardfitError(f"accelerate's ParallelismConfig has no expert-parallel dimension and this plan has "
                            f"ep={layout.ep}: run it with torchtitan or Megatron-LM (expert parallel {layout.ep}), or set "
                            "parallelism.ep to 1 in the plan (fit --data-parallel-only searches no layout)")
    notes = []
    if layout.tp > 1:
        notes.append(f"accelerate shards tp={layout.tp} with the model's own transformers tp_plan (gathered logits, "
                     "no sequence parallel): memory as `shardfit plan ... --tp N --no-loss-parallel` without --sp")
    return ({"parallelism_config_dp_replicate_size": layout.dp_replicate, "parallelism_config_dp_shard_size": layout.dp_shard,
             "parallelism_config_tp_size": layout.tp, "parallelism_config_cp_size": layout.cp}, notes)


def emit_accelerate(plan: Plan, options: EmitOptions) -> Emitted:
    config, notes = accelerate_config(plan, options)
    notes += [line for line in [optimizer_line(plan)] + trainer_kernel_notes(plan) if line]
    text = "# accelerate launch --config_file accelerate.yaml train.py   (written by shardfit)\n"
    text += "".join(f"# {line}\n" for line in [optimizer_line(plan)] + trainer_kernel_notes(plan) if line)
    text += yaml.safe_dump(config, sort_keys=True)
    return Emitted(files={"accelerate.yaml": text}, notes=tuple(notes))
