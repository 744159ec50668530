"""A Lightning Trainer script with the one shardfit line: tiny-llama, random tokens, CPU ranks.

    torchrun --nproc-per-node 2 lightning_script.py OUT_DIR STRATEGY [STEPS_TRACKED]

STRATEGY: ddp | fsdp | deepspeed | a file `shardfit emit --format lightning` wrote (its `strategy`).
"""
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from transformers import LlamaConfig, LlamaForCausalLM

from shardfit.integrations.lightning import ShardfitCallback
from shardfit.runtime_env import finish_rank

PRESET = Path(__file__).resolve().parents[2] / "src" / "shardfit" / "spec" / "presets" / "tiny-llama.json"
SEQ, MICRO = 64, 4


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=None, vocab=320):
        # SHARDFIT_TEST_SAMPLES=8: one batch per rank, seen again each step (the loss must fall).
        n = n or int(os.environ.get("SHARDFIT_TEST_SAMPLES", "256"))
        self.ids = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig(**json.loads(PRESET.read_text())))
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        return loss

    def configure_model(self):
        # ModelParallelStrategy (FSDP2 in Lightning): fully_shard per block, then the root.
        mesh = getattr(self, "device_mesh", None)
        if mesh is None or getattr(self, "_sharded", False):
            return
        from torch.distributed.fsdp import fully_shard

        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh["data_parallel"])
        fully_shard(self.model, mesh=mesh["data_parallel"])
        self._sharded = True

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=getattr(self, "lr", 1e-3), foreach=False)


def emitted_strategy(path: str):
    """`strategy` from a file `shardfit emit --format lightning` wrote: every statement but the
    L.Trainer(accelerator="gpu", ...) call, which this CPU script makes itself."""
    import ast

    tree = ast.parse(Path(path).read_text())
    tree.body = [node for node in tree.body if not (isinstance(node, ast.Assign) and
                                                     getattr(node.targets[0], "id", "") == "trainer")]
    scope: dict = {}
    exec(compile(tree, path, "exec"), scope)  # noqa: S102 - the test's own emitted file
    return scope["strategy"]


def strategy_of(name: str):
    if name.endswith(".py"):
        return cpu_strategy(emitted_strategy(name))
    if name == "fsdp":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return cpu_strategy(FSDPStrategy(auto_wrap_policy={LlamaDecoderLayer}, sharding_strategy="FULL_SHARD"))
    if name == "deepspeed":
        return cpu_strategy(DeepSpeedStrategy(stage=2))
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    return name


# Lightning refuses FSDP and DeepSpeed on its CPU accelerator by a type check (FSDP: `type(s) is
# FSDPStrategy`; DeepSpeed: setup_environment). The engines themselves run on CPU (gloo, DeepSpeed's
# CPU accelerator): these subclasses are the real strategies minus that check, so they run here.
class CPUFSDPStrategy(FSDPStrategy):
    pass


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    def setup_environment(self):
        DDPStrategy.setup_environment(self)


def cpu_strategy(strategy):
    if type(strategy) is FSDPStrategy:
        strategy.__class__ = CPUFSDPStrategy
    elif type(strategy) is DeepSpeedStrategy:
        strategy.__class__ = CPUDeepSpeedStrategy
    return strategy


def main():
    out, name = sys.argv[1], sys.argv[2]
    tracked = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    module = Module()
    lr = float(os.environ.get("SHARDFIT_TEST_LR", "1e-3"))
    module.lr = lr
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy_of(name), max_steps=4, precision="32-true",
                        default_root_dir=out, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ShardfitCallback(steps=tracked)])
    trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=MICRO))
    if trainer.is_global_zero:
        Path(out, "losses.json").write_text(json.dumps({"losses": module.losses}))


if __name__ == "__main__":
    main()
    finish_rank()  # gloo can abort a finished rank in the interpreter's teardown
