"""What each engine supports, checked on a Plan by spec/plan.py's validate_plan: offload (where each
engine has it) and the optimizer and precision combinations an engine rejects at run time. Each rule
is one line that names the fix; the first that applies is returned."""
from __future__ import annotations

from shardfit.spec.parallelism import MESH_STRATEGIES


def engine_support_error(plan) -> str | None:
    s, t, c = plan.strategy, plan.training, plan.cluster
    offload = s.offload_optimizer or s.offload_params
    if "nvme" in (s.offload_optimizer, s.offload_params) and not s.nvme_path:
        return "NVMe offload needs a path: set strategy.nvme_path in the plan, or --nvme-path (a local NVMe mount, e.g. /local_nvme)"
    if s.kind == "single" and c.world_size != 1:
        return (f"strategy single runs on one device, but the cluster has {c.world_size} GPUs ({c.nodes} node(s) x "
                f"{c.gpus_per_node}): use --gpus 1 (--nproc 1 for train/profile), or a data-parallel strategy "
                "(ddp, fsdp2, zero2, ...)")
    if s.kind == "single" and offload:
        return "single has no offload: use zero2+offload (optimizer) or zero3+offload / fsdp2+offload (parameters) on one GPU"
    if s.kind == "ddp" and offload:
        return "DDP has no offload: use zero2+offload (optimizer) or zero3+offload / fsdp2+offload (parameters)"
    if s.kind in ("zero1", "zero2") and s.offload_params:
        return f"{s.kind} keeps full parameters on every GPU: parameter offload needs zero3"
    if s.kind in ("zero1", "zero2") and s.offload_optimizer == "nvme":
        return f"{s.kind} accepts NVMe optimizer offload but silently uses CPU: use zero3 for NVMe, or cpu"
    if s.kind == "zero3" and s.offload_params and not s.offload_optimizer:
        return "zero3 parameter offload without optimizer offload is not supported by DeepSpeed: offload the optimizer too"
    if s.kind in ("fsdp", "fsdp2") and s.offload_optimizer:
        return f"{s.kind} offloads parameters, gradients and optimizer together: set offload_params: cpu instead of offload_optimizer"
    if s.kind in ("fsdp", "fsdp2") and s.offload_params == "nvme":
        return f"{s.kind} offloads to CPU only: use cpu, or zero3 for NVMe offload"
    if s.is_deepspeed and t.precision == "bf16-pure":
        return "DeepSpeed always keeps fp32 master weights: use precision bf16, or an FSDP strategy for pure bf16"
    if s.kind == "fsdp2" and t.optimizer == "adamw8bit":  # "got mixed torch.Tensor and DTensor" (bnb #1633)
        return ("bitsandbytes' 8-bit AdamW does not take FSDP2's DTensor parameters: use fsdp (FSDP1), zero1/2/3 or ddp "
                "with adamw8bit, or adamw with fsdp2")
    if s.is_deepspeed and t.optimizer in ("adamw8bit", "adafactor") and s.offload_optimizer:
        return f"DeepSpeed optimizer offload runs its own CPU Adam: {t.optimizer} can't be offloaded; use adamw"
    return None


def train_layout_error(plan) -> str | None:
    """What `shardfit train`'s loop cannot run: it runs data parallelism under every engine, tp under
    FSDP2 (a 2-D (dp, tp) mesh with the model's own TP plan; its head's logits stay vocab-sharded into
    torch's loss_parallel, or are gathered with loss_parallel false) and pp
    through the pipeline engine (engines/pipeline.py: its stages under single, DDP or FSDP2, tp inside)."""
    par = plan.parallelism
    if par.cp > 1:
        return ("`shardfit train` runs data, tensor (+ sequence), pipeline and expert parallelism so far: cp is for "
                "plan and emit (docs/parallelism.md); set it to 1")
    if par.ep > 1 and (plan.strategy.kind != "fsdp2" or par.tp > 1 or par.pp > 1):
        return (f"expert-parallel training runs over data-parallel FSDP2 ranks (transformers' EP, engines/"
                f"expert_parallel.py), not {plan.strategy.label} with tp = {par.tp}, pp = {par.pp}: use --strategy "
                "fsdp2 with tp and pp 1, or ep 1")
    if par.pp > 1 and plan.strategy.kind not in MESH_STRATEGIES:
        return (f"pipeline-parallel training runs its stages under {', '.join(MESH_STRATEGIES)}, not "
                f"{plan.strategy.label}: use --strategy fsdp2 or ddp, or pp 1")
    t = plan.training
    if par.pp > 1 and (t.lora is not None or t.activation_checkpointing != "none" or t.precision not in ("fp32", "bf16")):
        return ("the pipeline engine runs fp32 or bf16 without LoRA and activation checkpointing so far: set "
                "--ac none, no LoRA, --precision fp32 or bf16 (or pp 1)")
    if par.tp > 1 and par.pp == 1 and plan.strategy.kind != "fsdp2":
        return (f"tensor-parallel training runs under fsdp2 (FSDP2 x TP on a 2-D mesh), not {plan.strategy.label}: "
                "use --strategy fsdp2, or --tp 1")
    if par.tp > 1 and par.loss_parallel and t.loss == "chunked":
        return ("the chunked loss computes its own head in chunks, which the vocab-parallel loss cannot shard: set "
                "parallelism.loss_parallel false or training.loss standard")
    return None
