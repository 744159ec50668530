"""A plain Hugging Face Trainer script with the one shardfit line: tiny-llama from the shipped
config, random tokens, a few steps, on CPU ranks (torchrun, gloo).

    torchrun --nproc-per-node 2 hf_trainer_script.py OUT_DIR '{"per_device_train_batch_size": 4}' [STEPS_TRACKED]
"""
import json
import os
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from shardfit.integrations.transformers import ShardfitCallback
from shardfit.runtime_env import finish_rank

PRESET = Path(__file__).resolve().parents[2] / "src" / "shardfit" / "spec" / "presets" / "tiny-llama.json"
SEQ = 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=None, vocab=320):
        # SHARDFIT_TEST_SAMPLES=8: one batch per rank, seen again each step (the loss must fall).
        n = n or int(os.environ.get("SHARDFIT_TEST_SAMPLES", "256"))
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    out, overrides = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    tracked = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**json.loads(PRESET.read_text())))
    values = {"output_dir": out, "max_steps": 4, "per_device_train_batch_size": 4, "learning_rate": 1e-3,
              "optim": "adamw_torch", "use_cpu": True, "report_to": "none", "save_strategy": "no",
              "logging_steps": 1, "disable_tqdm": True, "dataloader_num_workers": 0, "seed": 0,
              "ddp_find_unused_parameters": False}
    values.update(overrides)
    # SHARDFIT_TEST_CALLBACK=0: the plain script (what `shardfit profile --script` measures instead).
    callbacks = [ShardfitCallback(steps=tracked)] if os.environ.get("SHARDFIT_TEST_CALLBACK", "1") == "1" else []
    trainer = Trainer(model=model, args=TrainingArguments(**values), train_dataset=Tokens(), callbacks=callbacks)
    result = trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    if trainer.is_world_process_zero():
        Path(out, "losses.json").write_text(json.dumps({"losses": losses, "train_loss": result.training_loss}))


if __name__ == "__main__":
    main()
    finish_rank()  # gloo can abort a finished rank in the interpreter's teardown
