"""Framework front-ends: HF TrainingArguments fields (JSON) and Lightning strategy arguments (Python)."""
from __future__ import annotations

import json
import pprint

from shardfit.emit.common import Emitted, EmitOptions, ac_every, block_class, block_module
from shardfit.emit.deepspeed import deepspeed_config
from shardfit.emit.kernels import hf_optim, optimizer_line, trainer_kernel_notes
from shardfit.spec.plan import Plan

_HF_OPTIM = {"adamw": "adamw_torch_fused", "adamw8bit": "adamw_bnb_8bit", "sgd": "sgd", "lion": "lion_32bit",
             "adafactor": "adafactor"}


def training_arguments(plan: Plan, options: EmitOptions) -> tuple[dict, list[str]]:
    """Keyword arguments for transformers.TrainingArguments (transformers 5.x names)."""
    s, t, sched = plan.strategy, plan.training, plan.schedule
    optim, notes = hf_optim(plan, _HF_OPTIM[t.optimizer])
    notes += trainer_kernel_notes(plan)
    args: dict = {
        "output_dir": options.out_dir,
        "per_device_train_batch_size": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "max_steps": sched.steps,
        "learning_rate": sched.lr,
        "lr_scheduler_type": "cosine_with_min_lr",
        "lr_scheduler_kwargs": {"min_lr_rate": sched.min_lr_ratio},
        "warmup_steps": sched.warmup_steps,
        "weight_decay": sched.weight_decay,
        # The optimizer the DeepSpeed JSON names (emit/deepspeed.py): HF's DeepSpeed integration refuses
        # a config whose betas / eps differ from these fields (found running the emitted pair).
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_epsilon": 1e-8,
        "max_grad_norm": sched.grad_clip,
        "seed": sched.seed,
        "logging_steps": max(sched.log_every, 1),
        "save_strategy": "steps" if sched.save_every else "no",
        "optim": optim,
        "bf16": t.precision in ("bf16", "bf16-pure"),
        "fp16": t.precision == "fp16",
    }
    if s.kind != "single":  # one device: no DDP wrapper to configure
        args["ddp_find_unused_parameters"] = False
    if sched.save_every:
        args["save_steps"] = sched.save_every
    every = ac_every(plan)
    fsdp_ac = s.kind in ("fsdp", "fsdp2") and every == 1
    if every and not fsdp_ac:
        # Non-reentrant checkpointing; every_n_layers keeps the plan's every-N choice.
        args["activation_checkpointing"] = True
        args["activation_checkpointing_kwargs"] = {"use_reentrant": False, "every_n_layers": every}
        if s.kind in ("fsdp", "fsdp2"):
            # FSDP's own checkpointing (fsdp_config) wraps every block: the plan's every-N needs the
            # Trainer's, which TrainingArguments warns about (transformers issue 30404).
            notes.append(f"checkpointing every {every} blocks under FSDP uses the Trainer's activation_checkpointing, "
                         "and transformers warns that it re-gathers each checkpointed block in the backward (one "
                         "redundant all-gather): plan with activation_checkpointing: full to use "
                         "fsdp_config.activation_checkpointing instead")
    if s.is_deepspeed:
        args["deepspeed"] = deepspeed_config(plan)
    elif s.kind in ("fsdp", "fsdp2"):
        version = 1 if s.kind == "fsdp" else 2
        config = {"version": version, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                  "transformer_layer_cls_to_wrap": [s.wrap_unit or block_class(plan.model)],
                  # Sharded checkpoints: HF's default FULL_STATE_DICT gathers the whole model on rank 0.
                  "state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": True,
                  "activation_checkpointing": fsdp_ac}
        if s.offload_params:
            config["cpu_offload"] = True
        if version == 2:
            config["reshard_after_forward"] = s.reshard_after_forward
            if (s.shard_group(plan.cluster.gpus_per_node) or plan.cluster.world_size) < plan.cluster.world_size:
                notes.append("HF Trainer has no FSDP2 hybrid mesh argument: use --format accelerate (parallelism_config)")
        else:
            notes.append("transformers 5 deprecates FSDP1 in the Trainer (TrainingArguments warns; removal announced): "
                         "plan with strategy fsdp2 for the fsdp_config version 2 path")
            config["reshard_after_forward"] = s.sharding
            config["backward_prefetch"] = s.backward_prefetch.upper().replace("NONE", "NO_PREFETCH")
            config["use_orig_params"] = True
            config["sync_module_states"] = True
        args["fsdp"] = True
        args["fsdp_config"] = config
    if s.kind == "single":
        notes.append("one device: launch with `python train.py`; with one process the Trainer wraps nothing "
                     "(no DDP, FSDP or DeepSpeed)")
    if t.lora is not None:
        notes.append(f"LoRA is set on the model, not in TrainingArguments: peft.LoraConfig(r={t.lora.rank}, "
                     f"lora_alpha={t.lora.alpha}, target_modules={list(t.lora.target_modules)})")
    return args, notes


def emit_hf_trainer(plan: Plan, options: EmitOptions) -> Emitted:
    args, notes = training_arguments(plan, options)
    notes.append("load with TrainingArguments(**json.load(open('training_args.json')))")
    return Emitted(files={"training_args.json": json.dumps(args, indent=2) + "\n"}, notes=tuple(notes))


def _fully_shard_arguments(s) -> str:
    reshard = s.reshard_after_forward and s.sharding != "shard_grad_op"
    offload = ", offload_policy=CPUOffloadPolicy()" if s.offload_params else ""
    return f"fully_shard(block, mesh=..., reshard_after_forward={reshard}{offload})"


_LIGHTNING_PRECISION = {"bf16": "bf16-mixed", "bf16-pure": "bf16-true", "fp16": "16-mixed", "fp32": "32-true"}


def emit_lightning(plan: Plan, options: EmitOptions) -> Emitted:
    s, t, c, sched = plan.strategy, plan.training, plan.cluster, plan.schedule
    lines = [f'"""Lightning Trainer arguments written by shardfit for {plan.model.name}: {s.label}."""',
             "import lightning as L"]
    if s.is_deepspeed:
        config = deepspeed_config(plan)
        # Lightning sets the accumulation from Trainer(accumulate_grad_batches=...) and refuses the key
        # in the config ("Do not set `gradient_accumulation_steps` in the DeepSpeed config") at fit.
        del config["gradient_accumulation_steps"]
        lines += ["from lightning.pytorch.strategies import DeepSpeedStrategy", "",
                  f"DEEPSPEED_CONFIG = {pprint.pformat(config, sort_dicts=False)}",
                  "strategy = DeepSpeedStrategy(config=DEEPSPEED_CONFIG)"]
    elif s.kind == "fsdp":
        block = s.wrap_unit or block_class(plan.model)
        lines += ["from lightning.pytorch.strategies import FSDPStrategy",
                  f"from {block_module(plan.model)} import {block}", ""]
        kwargs = [f"auto_wrap_policy={{{block}}}", f'sharding_strategy="{s.sharding.upper()}"',
                  'state_dict_type="sharded"', f"cpu_offload={bool(s.offload_params)}"]
        if ac_every(plan):
            kwargs.append(f"activation_checkpointing_policy={{{block}}}")
        if s.sharding == "hybrid_shard":
            group = s.shard_group_size or c.gpus_per_node
            kwargs.append(f"device_mesh=({c.world_size // group}, {group})")
        lines.append("strategy = FSDPStrategy(" + ", ".join(kwargs) + ")")
    elif s.kind == "fsdp2":
        group = s.shard_group(c.gpus_per_node) or c.world_size
        lines += ["from lightning.pytorch.strategies import ModelParallelStrategy", "",
                  "# FSDP2 in Lightning: apply fully_shard per block (then the root) in LightningModule.configure_model,",
                  "# e.g. with the shard() function of `shardfit emit --format fsdp2`; this plan's arguments:",
                  f"# {_fully_shard_arguments(s)}",
                  f"strategy = ModelParallelStrategy(data_parallel_size={group}, tensor_parallel_size=1)"]
    elif s.kind == "single":
        lines += ["", 'strategy = "auto"  # one device: Lightning runs SingleDeviceStrategy, no DDP wrapper']
    else:
        lines += ["", f'strategy = "{"ddp" if c.world_size > 1 else "auto"}"']
    lines += ["", "trainer = L.Trainer(", '    accelerator="gpu",', f"    devices={c.gpus_per_node},",
              f"    num_nodes={c.nodes},", "    strategy=strategy,",
              f'    precision="{_LIGHTNING_PRECISION[t.precision]}",',
              f"    accumulate_grad_batches={t.grad_accum},"]
    if not s.is_deepspeed:  # DeepSpeed takes clipping from its config
        lines.append(f"    gradient_clip_val={sched.grad_clip},")
    lines += [f"    max_steps={sched.steps},", ")",
              f"# DataLoader batch_size={t.micro_batch} (per device), sequences of {t.seq_len} tokens"]
    notes = trainer_kernel_notes(plan)
    lines += [f"# {line}" for line in [optimizer_line(plan)] + notes if line] + [""]
    return Emitted(files={"lightning_strategy.py": "\n".join(lines)}, notes=tuple(notes))
