"""Runs under torchrun: several training configurations in ONE process group, results as JSON.

    torchrun --nproc-per-node 2 tests/engines/worker.py SPEC.json RESULT.json

SPEC.json is a list of jobs: {"name", "plan": {...plan dict...}, "out": dir, "resume": null|dir,
"logits": bool (record the final model's logits on a fixed input), "export": null|dir,
"generate": bool}. Launch count is what costs time on CPU, so tests batch their configurations here.
"""
from __future__ import annotations

import json
import sys
import time
import traceback

import torch
import torch.distributed as dist

from shardfit.engines.base import init_distributed
from shardfit.runtime_env import leave
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import plan_from_dict
from shardfit.train.loop import RunOptions, train

PROBE = [[256, 73, 110, 32, 116, 104, 101, 32, 109, 111, 114, 110, 105, 110, 103]]  # "<bos>In the morning"


def _mlp_calls(engine) -> int:
    """How often the first block's MLP runs in one training micro-step (2 = recomputed by AC)."""
    from shardfit.data import collate

    block = next(m for m in engine.module.modules() if type(m).__name__.endswith("DecoderLayer"))
    calls = []
    original = block.mlp.forward

    def counted(*args, **kwargs):  # NOTE: not a forward hook: torch does not fire hooks in the recompute
        calls.append(1)
        return original(*args, **kwargs)

    block.mlp.forward = counted
    try:
        engine.forward_backward(collate([tuple(range(1, 17))] * engine.plan.training.micro_batch, 258), True)
    finally:
        del block.mlp.forward
    engine.zero_grad()
    return len(calls)


def main(spec_path: str, result_path: str) -> int:
    ctx = init_distributed()
    jobs = json.loads(open(spec_path).read())
    results = {}
    for job in jobs:
        started = time.perf_counter()
        try:
            plan = plan_from_dict(job["plan"], resolve_model=load_model_spec)
            finished = {}  # the engine after the run, from RunOptions.on_finish
            options = RunOptions(resume=job.get("resume"), progress=False, quiet=True, export=job.get("export"),
                                 eval_batches=2, new_tokens=job.get("new_tokens", 12),
                                 on_finish=lambda engine: finished.update(engine=engine))
            records = train(plan, job["out"], options, ctx=ctx)
            result = {"losses": [r["loss"] for r in records], "steps": [r["step"] for r in records],
                      "records": records, "ok": True}
            engine = finished.pop("engine")
            if job.get("logits"):
                with engine.inference() as model:
                    logits = model(input_ids=torch.tensor(PROBE, device=ctx.device)).logits.float()
                result["logits"] = logits[0, -3:, :8].tolist()
            if job.get("generate"):
                from shardfit.data import ByteTokenizer
                from shardfit.train.generate import engine_generate
                result["generated"] = engine_generate(engine, ByteTokenizer(), "In the morning", 12)[0]
            if job.get("count_recompute"):
                result["mlp_calls"] = _mlp_calls(engine)
            del engine
        except Exception as exc:  # noqa: BLE001 - report per job, keep the group alive for the others
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - started, 2)
        results[job["name"]] = result
        if ctx.rank == 0:
            print(f"[worker] {job['name']}: {'ok' if result['ok'] else result['error']} ({result['seconds']} s)", flush=True)
        dist.barrier()
    if ctx.rank == 0:
        with open(result_path, "w") as fh:
            json.dump(results, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main(sys.argv[1], sys.argv[2]))  # without the interpreter's teardown, where gloo can abort a finished rank
