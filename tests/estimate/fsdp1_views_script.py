"""Run under torchrun: for each tiny config folder named on the command line, shardfit's FSDP1 engine
wraps the model (fp32, then bf16 MixedPrecision) and rank 0 writes every rank's optimizer views
(elements per parameter, in the optimizer's order) to OUT.

    torchrun --nproc-per-node 2 fsdp1_views_script.py OUT.json MODEL_DIR...
"""
import json
import sys

import torch.distributed as dist

from shardfit.engines import fsdp
from shardfit.engines.base import init_distributed
from shardfit.modeling import build_model
from shardfit.runtime_env import finish_rank
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import plan_from_dict


def main():
    out, folders = sys.argv[1], sys.argv[2:]
    ctx = init_distributed()
    found = {}
    for folder in folders:
        for precision in ("fp32", "bf16"):
            plan = plan_from_dict({"model": folder, "strategy": {"kind": "fsdp"},
                                   "cluster": {"nodes": 1, "gpus_per_node": ctx.world_size},
                                   "training": {"micro_batch": 1, "seq_len": 16, "precision": precision}},
                                  resolve_model=load_model_spec)
            engine = fsdp.setup(plan, build_model(plan.model, seed=0), ctx)
            views = [p.numel() for group in engine.optimizer.param_groups for p in group["params"]]
            every = [None] * ctx.world_size
            dist.all_gather_object(every, views)
            found[f"{folder}|{precision}"] = every
    if ctx.is_main:
        with open(out, "w") as fh:
            json.dump(found, fh)


if __name__ == "__main__":
    main()
    finish_rank()
