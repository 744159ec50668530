"""The configurations the engine tests run, as worker job lists (see worker.py)."""
from __future__ import annotations

from shardfit.spec.plan import is_deepspeed_kind

ENGINES = ("ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3")
STEPS = 5
# Small DeepSpeed buckets: the defaults (5e8 elements) allocate ~1-2 GB per rank for a tiny model.
DS_BUCKETS = {"reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000, "prefetch_bucket_size": 200_000,
              "param_persistence_threshold": 1000}


def plan(engine: str, precision: str = "fp32", ac: str = "none", steps: int = STEPS, grad_accum: int = 1,
         save_every: int = 0, eval_every: int = 0, **strategy) -> dict:
    strategy = {"kind": engine, **(DS_BUCKETS if is_deepspeed_kind(engine) else {}), **strategy}
    cluster = {"nodes": 1, "gpus_per_node": 1} if engine == "single" else {}
    return {"model": "tiny-llama", "strategy": strategy, "cluster": cluster,
            "training": {"micro_batch": 2, "seq_len": 64, "grad_accum": grad_accum, "precision": precision,
                         "activation_checkpointing": ac},
            "schedule": {"steps": steps, "lr": 3e-3, "warmup_steps": 1, "log_every": 100, "eval_every": eval_every,
                         "save_every": save_every, "keep_checkpoints": 3, "seed": 11}}


def lora_plan(engine: str) -> dict:
    data = plan(engine, ac="full", save_every=STEPS)  # LoRA with activation checkpointing: the usual setup
    data["training"]["lora"] = {"rank": 4, "base_dtype": "fp32"}
    return data


def nan_plan(policy: str) -> dict:
    # AdamW moves every weight by about lr whatever the gradient: lr 1e12 without clipping overflows
    # the logits on the next forward.
    data = plan("ddp", steps=4)
    data["schedule"].update({"lr": 1e12, "grad_clip": 0.0, "warmup_steps": 0, "nan_policy": policy})
    return data


def matrix_jobs(root: str, reference_root: str) -> list[dict]:
    jobs = [{"name": "fsdp2-1to2", "plan": plan("fsdp2"), "out": f"{root}/1to2",
             "resume": f"{reference_root}/single/checkpoints/step-2"}]
    for engine in ENGINES:
        # fp32 without AC is the reference run: it also saves checkpoints, exports and generates.
        # Evaluation (val loss + a generated sample, parameters gathered) at steps 2 and 4 must not
        # disturb training: the resumed run never evaluated at step 2 and must still match exactly.
        jobs.append({"name": f"{engine}-fp32-none", "plan": plan(engine, save_every=2, eval_every=2),
                     "out": f"{root}/{engine}",
                     "export": f"{root}/{engine}-hf", "logits": True, "generate": True, "count_recompute": True})
        jobs.append({"name": f"{engine}-resume", "plan": plan(engine, save_every=2, eval_every=2),
                     "out": f"{root}/{engine}-resumed",
                     "resume": f"{root}/{engine}/checkpoints/step-2"})
        for precision, ac in (("fp32", "full"), ("bf16", "none"), ("bf16", "full")):
            jobs.append({"name": f"{engine}-{precision}-{ac}", "plan": plan(engine, precision, ac),
                         "out": f"{root}/{engine}-{precision}-{ac}", "count_recompute": precision == "fp32"})
    # DCP -> DeepSpeed: ZeRO engines resume directly from the FSDP2 run's checkpoint (written above).
    jobs += [{"name": f"{stage}-from-fsdp2", "plan": plan(stage), "out": f"{root}/{stage}-from-fsdp2",
              "resume": f"{root}/fsdp2/checkpoints/step-2"} for stage in ("zero1", "zero2", "zero3")]
    # Breadth: accumulation, FSDP1 hybrid shard, FSDP2 HSDP (2,1) and CPU offload, LoRA, fp16.
    jobs += [
        {"name": "ddp-accum2", "plan": plan("ddp", grad_accum=2, steps=3), "out": f"{root}/ddp-accum2"},
        {"name": "fsdp2-accum2", "plan": plan("fsdp2", grad_accum=2, steps=3), "out": f"{root}/fsdp2-accum2"},
        {"name": "zero2-accum2", "plan": plan("zero2", grad_accum=2, steps=3), "out": f"{root}/zero2-accum2"},
        {"name": "fsdp-hybrid", "plan": plan("fsdp", sharding="hybrid_shard", shard_group_size=2),
         "out": f"{root}/fsdp-hybrid"},
        {"name": "fsdp2-hsdp", "plan": plan("fsdp2", shard_group_size=1), "out": f"{root}/fsdp2-hsdp"},
        {"name": "fsdp2-offload", "plan": plan("fsdp2", offload_params="cpu"), "out": f"{root}/fsdp2-offload"},
        *[{"name": f"{engine}-lora", "plan": lora_plan(engine), "out": f"{root}/{engine}-lora",
           "export": f"{root}/{engine}-lora-hf", "logits": True} for engine in ("ddp", "fsdp", "fsdp2", "zero3")],
        {"name": "ddp-fp16", "plan": plan("ddp", "fp16"), "out": f"{root}/ddp-fp16"},
        {"name": "zero2-offload", "plan": plan("zero2", offload_optimizer="cpu"), "out": f"{root}/zero2-offload"},
        {"name": "zero3-offload", "plan": plan("zero3", offload_optimizer="cpu", offload_params="cpu", save_every=2),
         "out": f"{root}/zero3-offload"},
        {"name": "zero3-offload-resume", "plan": plan("zero3", offload_optimizer="cpu", offload_params="cpu", save_every=2),
         "out": f"{root}/zero3-offload-resumed", "resume": f"{root}/zero3-offload/checkpoints/step-2"},
        {"name": "ddp-nan-stop", "plan": nan_plan("stop"), "out": f"{root}/nan-stop"},
        {"name": "ddp-nan-skip", "plan": nan_plan("skip"), "out": f"{root}/nan-skip"},
        {"name": "fsdp2-fp16", "plan": plan("fsdp2", "fp16"), "out": f"{root}/fsdp2-fp16"},
    ]
    return jobs


def reference_jobs(root: str) -> list[dict]:
    """One process, before the matrix: accumulating the two ranks' micro-batches is the same math
    as 2 ranks; its step-2 checkpoint is resumed by 2 ranks (DCP 1 -> 2). The single engine (no
    wrapper) runs here too: it is that same one-process math without DDP's reducer."""
    single = plan("single", grad_accum=2, save_every=2, eval_every=2)
    return [{"name": "single-ddp-accum2", "plan": plan("ddp", grad_accum=2, save_every=2), "out": f"{root}/single"},
            {"name": "single-fp32-none", "plan": single, "out": f"{root}/single-engine",
             "export": f"{root}/single-engine-hf", "logits": True, "generate": True, "count_recompute": True},
            {"name": "single-resume", "plan": single, "out": f"{root}/single-engine-resumed",
             "resume": f"{root}/single-engine/checkpoints/step-2"},
            {"name": "single-fp32-full", "plan": plan("single", "fp32", "full", grad_accum=2),
             "out": f"{root}/single-fp32-full", "count_recompute": True},
            {"name": "single-bf16-full", "plan": plan("single", "bf16", "full", grad_accum=2),
             "out": f"{root}/single-bf16-full"},
            {"name": "single-fp16", "plan": plan("single", "fp16", grad_accum=2), "out": f"{root}/single-fp16"}]


def single_rank_jobs(root: str, matrix_root: str) -> list[dict]:
    """One process: the reference loss (accumulating the two ranks' micro-batches) and DCP 2 -> 1."""
    return [
        {"name": "fsdp2-2to1", "plan": plan("fsdp2", grad_accum=2, save_every=2), "out": f"{root}/2to1",
         "resume": f"{matrix_root}/fsdp2/checkpoints/step-2"},
        {"name": "fsdp2-from-zero2", "plan": plan("fsdp2", grad_accum=2), "out": f"{root}/from-zero2",
         "resume": f"{matrix_root}/../zero2-as-dcp"},
        {"name": "ddp-from-zero3", "plan": plan("ddp", grad_accum=2), "out": f"{root}/from-zero3",
         "resume": f"{matrix_root}/../zero3-as-dcp"},
        {"name": "finetune-from-export", "plan": {**plan("ddp", grad_accum=2, steps=2), "model": f"{matrix_root}/ddp-hf"},
         "out": f"{root}/finetune"},
        {"name": "ddp-from-fsdp2-2to1", "plan": plan("ddp", grad_accum=2, save_every=2), "out": f"{root}/2to1-ddp",
         "resume": f"{matrix_root}/fsdp2/checkpoints/step-2"},
        {"name": "single-from-fsdp2-2to1", "plan": plan("single", grad_accum=2), "out": f"{root}/2to1-single",
         "resume": f"{matrix_root}/fsdp2/checkpoints/step-2"},
    ]
