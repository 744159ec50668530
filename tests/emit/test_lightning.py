"""The emitted Lightning arguments through Lightning itself: the strategy objects construct, and a
Trainer accepts them (on CPU where Lightning allows it; FSDP's Trainer insists on a GPU)."""
import pytest

from shardfit.emit import emit
from test_emit_configs import BIG, make

L = pytest.importorskip("lightning")
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy  # noqa: E402


@pytest.mark.parametrize("strategy,expected", [
    ("zero3+offload", DeepSpeedStrategy), ("fsdp", FSDPStrategy), ("fsdp:hybrid_shard", FSDPStrategy),
    ("fsdp2", ModelParallelStrategy), ("ddp", DDPStrategy),
])
def test_lightning_builds_the_emitted_strategy(strategy, expected):
    plan = make(strategy, model=BIG, nodes=2, gpus=4, ac="full")
    text = emit(plan, "lightning").main
    head, _, trainer_call = text.partition("trainer = L.Trainer(")
    namespace: dict = {}
    exec(compile(head, "lightning_strategy.py", "exec"), namespace)
    built = namespace["strategy"]
    if expected is DeepSpeedStrategy:
        assert isinstance(built, DeepSpeedStrategy)
        assert built.config["zero_optimization"]["stage"] == 3
        assert built.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    elif expected is FSDPStrategy:
        assert isinstance(built, FSDPStrategy)
        assert built.sharding_strategy.name == (strategy.partition(":")[2].upper() or "FULL_SHARD")
        return  # Lightning's Trainer refuses FSDP without a GPU
    elif expected is ModelParallelStrategy:
        assert isinstance(built, ModelParallelStrategy)
    cpu_text = text.replace('accelerator="gpu"', 'accelerator="cpu"')
    exec(compile(cpu_text, "lightning_strategy.py", "exec"), namespace)
    trainer = namespace["trainer"]
    assert isinstance(trainer.strategy, expected)
    assert (trainer.num_nodes, trainer.num_devices) == (2, 4)
    assert trainer.accumulate_grad_batches == plan.training.grad_accum
