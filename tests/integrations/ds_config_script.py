"""A plain DeepSpeed loop on an emitted ds_config.json, measured by shardfit's tracker: tiny-llama
from the shipped config, one batch per rank seen again each step, CPU ranks (gloo). DeepSpeed
builds the optimizer the JSON names (its FusedAdam, a compiled CPU op).

    deepspeed --hostfile hostfile ... ds_config_script.py ds_config.json OUT_DIR STEPS
"""
import json
import sys
from pathlib import Path

import deepspeed
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import shardfit
from shardfit.measure.report import gather
from shardfit.runtime_env import finish_rank

PRESET = Path(__file__).resolve().parents[2] / "src" / "shardfit" / "spec" / "presets" / "tiny-llama.json"
SEQ = 64


def main():
    config_path, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**json.loads(PRESET.read_text())))
    config = json.loads(Path(config_path).read_text())
    ids = torch.randint(0, 320, (config["train_micro_batch_size_per_gpu"], SEQ),
                        generator=torch.Generator().manual_seed(rank))
    profiler = shardfit.profile(label="deepspeed").__enter__()  # from before the engine: its load is measured
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    profiler.attach(engine, optimizer)
    losses = []
    for step in range(steps):
        for _ in range(engine.gradient_accumulation_steps()):
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
        if step == 1:
            profiler.__exit__(None, None, None)
    gathered = gather(profiler.report())
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({
            "losses": losses, "stage": engine.zero_optimization_stage(), "world": engine.world_size,
            "optimizer": type(getattr(engine, "basic_optimizer", None)).__name__,
            "phases": gathered.phases, "peak_by_rank": gathered.peak_by_rank()}))


if __name__ == "__main__":
    main()
    finish_rank()  # gloo can abort a finished rank in the interpreter's teardown
