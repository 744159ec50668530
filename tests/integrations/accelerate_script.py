"""A custom Accelerate loop with the one shardfit line: tiny-llama, random tokens, CPU ranks.

    torchrun --nproc-per-node 2 accelerate_script.py OUT_DIR '{"micro_batch": 4}' [STEPS_TRACKED]
    accelerate launch --config_file CFG.yaml accelerate_script.py OUT_DIR '{}'

Options (JSON): micro_batch, grad_accum, activation_checkpointing (bool), steps, track (bool).
"""
import json
import math
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from shardfit.integrations.accelerate import track
from shardfit.runtime_env import finish_rank

PRESET = Path(__file__).resolve().parents[2] / "src" / "shardfit" / "spec" / "presets" / "tiny-llama.json"
SEQ = 64


def main():
    out = sys.argv[1]
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    tracked = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=options.get("grad_accum", 1))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**json.loads(PRESET.read_text())))
    if options.get("activation_checkpointing"):
        model.gradient_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(0, 320, (256, SEQ), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids],
                                         batch_size=options.get("micro_batch", 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if options.get("track", True):  # false: the plain loop (what `shardfit profile --script` measures instead)
        track(accelerator, model, optimizer, steps=tracked, out_dir=out)
    losses, steps = [], options.get("steps", 4)
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if accelerator.sync_gradients:
            losses.append(float(loss.detach()))
            if len(losses) == steps:
                break
    assert all(math.isfinite(x) for x in losses)
    if accelerator.is_main_process:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "losses.json").write_text(json.dumps({"losses": losses}))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # tears the process group down together (gloo aborts on a lone exit)


if __name__ == "__main__":
    main()
    finish_rank()  # gloo can abort a finished rank in the interpreter's teardown
