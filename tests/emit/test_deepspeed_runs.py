"""The emitted DeepSpeed JSON drives a real 2-rank DeepSpeed run (gloo on CPU): ZeRO-2 with CPU
optimizer offload in bf16, and ZeRO-3 in fp32, one optimizer step each."""
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from launch import torchrun
from shardfit.emit import emit
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

pytestmark = [pytest.mark.multirank, pytest.mark.deepspeed]


def test_emitted_deepspeed_configs_train_on_two_ranks(tmp_path):
    paths = []
    for name, strategy, precision in (("z2off", "zero2+offload", "bf16"), ("z3", "zero3", "fp32")):
        # Small buckets: DeepSpeed's 5e8-element defaults would allocate ~1 GB per rank for a 0.2M model.
        s = replace(parse_strategy(strategy), reduce_bucket_size=4096, allgather_bucket_size=4096,
                    prefetch_bucket_size=4096)
        plan = Plan(model=load_model_spec("tiny-llama"), strategy=s,
                    training=Training(micro_batch=2, grad_accum=2, precision=precision),
                    cluster=Cluster(nodes=1, gpus_per_node=2, gpu="custom:1"))
        path = tmp_path / f"{name}.json"
        path.write_text(emit(plan, "deepspeed").main)
        paths.append(str(path))
    script = Path(__file__).with_name("ds_run_emitted.py")
    result = torchrun([str(script), *paths], nproc=2, timeout=400)
    runs = [json.loads(m) for m in re.findall(r"^RESULT (.*)$", result.stdout, flags=re.M)]
    assert [r["stage"] for r in runs] == [2, 3]
    for run in runs:
        assert run["world"] == 2 and run["train_batch_size"] == 8 and run["steps"] == 1
        assert len(run["losses"]) == 2 and all(0 < loss < 20 for loss in run["losses"])
