"""The other two accountings of estimate(): the ZeRO paper's model-state formulas ("ideal") and
DeepSpeed's own estimator functions ("deepspeed"), each as (params, grads, optimizer[, temporaries])."""
from __future__ import annotations

from shardfit.estimate import states as sts
from shardfit.estimate.deepspeed_reference import zero2_model_states, zero3_model_states


def ideal_states(plan, shard, trained, frozen_bytes, factored, lp, host, term, notes):
    """The ZeRO paper's model states, FSDP mapped onto its stages; no buffers."""
    s = plan.strategy
    stage = {"single": 0, "ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}.get(s.kind, 3)
    if s.kind == "fsdp" and s.sharding == "shard_grad_op":
        stage = 2
    if s.kind == "fsdp" and s.sharding == "no_shard":
        stage = 0
    params, grads, opt, k = sts.ideal_states(stage, shard if stage else 1, plan.training.precision,
                                             plan.training.optimizer, trained, factored)
    params += int(frozen_bytes / (shard if stage >= 3 else 1))
    if s.offload_optimizer or (s.offload_params and s.kind in ("fsdp", "fsdp2")):
        host["offloaded_optimizer"] = opt
        opt = 0
    if notes is not None:
        term("ideal.model_states", params + grads + opt,
             "params 2P(/N at stage 3) + grads 2P(/N at stage>=2) + K*P(/N at stage>=1)",
             {"stage": stage, "N": shard, "P": trained, "K": k, "lp": lp},
             "ZeRO paper (Rajbhandari et al. 2020) sec. 5, Figure 1")
        notes.append(f"ideal accounting: ZeRO stage {stage} formulas; no buffers, no runtime overhead")
    return params, grads, opt


def deepspeed_estimator_states(plan, largest, host, term, notes):
    """DeepSpeed's own estimator (zero2/zero3), split into our categories: (params, grads, opt, temps)."""
    s, c, n = plan.strategy, plan.cluster, plan.model.n_params
    world, per_node = c.nodes * c.gpus_per_node, c.gpus_per_node
    if s.kind == "zero2":
        cpu_mem, gpu_mem = zero2_model_states(n, per_node, c.nodes, cpu_offload=bool(s.offload_optimizer))
        params, temps = 2 * n, 0
    else:
        cpu_mem, gpu_mem, temps = zero3_model_states(n, largest, per_node, c.nodes,
                                                     cpu_offload=bool(s.offload_optimizer),
                                                     cpu_offload_params=bool(s.offload_params))
        params = int(2 * n / world) if (s.offload_optimizer and not s.offload_params) else 0
    opt = 0 if s.offload_optimizer else int(12 * n / world)
    host["deepspeed_estimate"] = int(cpu_mem / per_node)
    if notes is not None:
        term("deepspeed.model_states", gpu_mem, "zero2: 2P + 18P/N; zero3: 4*largest + 18P/N (offload: 2P/N or 0)",
             {"P": n, "largest_layer": largest, "gpus_per_node": per_node, "nodes": c.nodes,
              "offload_optimizer": s.offload_optimizer, "offload_params": s.offload_params},
             "DeepSpeed estimate_zero{2,3}_model_states_mem_needs")
        term("deepspeed.cpu_per_node", cpu_mem, "DeepSpeed's cpu figure (1.5 buffer factor)", {}, "DeepSpeed")
        notes.append("deepspeed accounting: DeepSpeed's own estimator (no activations, buckets or overhead)")
    return params, gpu_mem - params - temps - opt, opt, temps
