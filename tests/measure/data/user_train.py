"""A user's own DDP training script, unaware of shardfit (profiled by `shardfit profile --script`)."""
import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=2)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--fail-at-step", type=int, default=None, help="raise after this step's backward (a broken script)")
parser.add_argument("--os-exit", type=int, default=None, help="end with os._exit(CODE), as emitted CPU scripts do")
args = parser.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(args.width, 4 * args.width), torch.nn.GELU(), torch.nn.Linear(4 * args.width, args.width)))
optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
for step in range(args.steps):
    x = torch.randn(64, args.width)
    loss = model(x).pow(2).mean()
    loss.backward()
    if step + 1 == args.fail_at_step:
        print("checking the gradients", file=sys.stderr)
        raise RuntimeError(f"gradient check failed at step {step + 1}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
dist.destroy_process_group()
if args.os_exit is not None:
    sys.stdout.flush()
    os._exit(args.os_exit)
