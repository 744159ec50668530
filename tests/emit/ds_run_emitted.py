"""Run under torchrun: each DeepSpeed JSON named on the command line trains a tiny Llama for one
optimizer step through deepspeed.initialize, and rank 0 prints what DeepSpeed understood."""
import json
import sys

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from shardfit.runtime_env import finish_rank


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    for path in sys.argv[1:]:
        torch.manual_seed(0)
        config = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=320, use_cache=False)
        model = AutoModelForCausalLM.from_config(config)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=path)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(engine.gradient_accumulation_steps()):
            ids = torch.randint(0, 320, (engine.train_micro_batch_size_per_gpu(), 16), generator=gen)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        if rank == 0:
            print("RESULT " + json.dumps({"path": path, "stage": engine.zero_optimization_stage(),
                                          "train_batch_size": engine.train_batch_size(),
                                          "world": engine.world_size, "steps": engine.global_steps,
                                          "losses": losses}), flush=True)
        engine.destroy() if hasattr(engine, "destroy") else None


if __name__ == "__main__":
    main()
    finish_rank()  # gloo can abort a finished rank in the interpreter's teardown
