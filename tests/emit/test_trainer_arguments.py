"""What `emit -f hf-trainer` and `emit -f lightning` write, for every strategy, taken by the tools'
own objects the way their trainers take them: TrainingArguments(**emitted) and the FSDP plugin the
Trainer builds from it, Lightning's strategy objects, the Trainer around them and Lightning's own
DeepSpeed-config formatting. Warnings are errors and the tools' warning logs are collected: a key a
current version renamed, deprecated or ignores fails here, not in a user's first run. The one
deprecation left (transformers' FSDP1) is the plan's own choice, and emit's notes say so."""
from __future__ import annotations

import inspect
import json
import logging
import os
import warnings
from contextlib import contextmanager

import pytest

from shardfit.emit import emit
from shardfit.spec.plan import parse_strategy
from test_emit_configs import BIG, make

STRATEGIES = ["single", "ddp", "fsdp", "fsdp:shard_grad_op", "fsdp:hybrid_shard", "fsdp+offload", "fsdp2",
              "fsdp2:no_reshard", "fsdp2+offload", "zero1", "zero2", "zero3", "zero2+offload", "zero3+offload"]
# transformers' FSDP1 path, warned on every TrainingArguments(fsdp_config={"version": 1, ...}).
FSDP1_DEPRECATED = "FSDP1 (`fsdp_config['version'] = 1`) is deprecated"
# transformers on the Trainer's activation_checkpointing under FSDP (what an every-N plan needs).
REDUNDANT_ALLGATHER = "prefer `fsdp_config['activation_checkpointing']`"


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextmanager
def warnings_as_errors(*loggers: str):
    """Python warnings raise; WARNING records of the named loggers (transformers and Lightning log
    their deprecations rather than warn) are collected and yielded."""
    handler = _Collect()
    for name in loggers:
        logging.getLogger(name).addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            yield handler.messages
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(handler)


@pytest.fixture(scope="module", autouse=True)
def _imported():
    """The tools imported (and DeepSpeed's accelerator chosen, which logs a warning on a machine
    without a GPU) before any check: what an import warns about is not about the emitted keys."""
    for name in ("transformers", "accelerate.utils", "lightning.pytorch", "deepspeed.runtime.config"):
        pytest.importorskip(name)
    from deepspeed.accelerator import get_accelerator

    get_accelerator()


def _plan(strategy: str, ac: str = "none", precision: str = "bf16"):
    # DeepSpeed on one GPU: HF compares the JSON's train_batch_size with this process's world of one.
    gpus = 1 if strategy == "single" or parse_strategy(strategy).is_deepspeed else 8
    return make(strategy, model=BIG, gpus=gpus, ac=ac, precision=precision)


# ---- HF Trainer ---------------------------------------------------------------------------------
def _training_arguments(fields: dict, tmp_path):
    from transformers import TrainingArguments

    # A copy: TrainingArguments fills its defaults into the fsdp_config dict it is given. use_cpu only
    # because this machine has no GPU; it is not one of the emitted fields.
    fields = json.loads(json.dumps(fields))
    return TrainingArguments(**{**fields, "output_dir": str(tmp_path)}, use_cpu=True)


def _perturbed(value):
    """A different value of the same type (a key transformers reads then changes what it builds)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, list):
        return [*value, "OtherBlock"]
    return f"{value}_other"


def _ignored_fsdp_keys(fields: dict, args, tmp_path) -> list[str]:
    """The fsdp_config keys transformers does not read: a changed value of a key it reads changes the
    plugin arguments it builds (or is refused). It ignores a key it does not know, so acceptance
    alone proves nothing."""
    ignored = []
    for key, value in fields["fsdp_config"].items():
        changed = {**fields, "fsdp_config": {**fields["fsdp_config"], key: _perturbed(value)}}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                other = _training_arguments(changed, tmp_path)
        except ValueError:
            continue
        if other.fsdp_plugin_args == args.fsdp_plugin_args:
            ignored.append(key)
    return ignored


def test_an_fsdp_key_transformers_does_not_read_is_found(tmp_path):
    fields = json.loads(emit(_plan("fsdp2"), "hf-trainer").main)
    fields["fsdp_config"].update(sync_module_states=True, fsdp_limit_all_gathers=True)  # FSDP1-only keys
    assert _ignored_fsdp_keys(fields, _training_arguments(fields, tmp_path), tmp_path) == [
        "sync_module_states", "fsdp_limit_all_gathers"]


@pytest.mark.parametrize("ac", ["none", "full", "every-2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_training_arguments_take_every_emitted_key_without_warnings(tmp_path, monkeypatch, strategy, ac):
    for key in [k for k in os.environ if k.startswith(("FSDP_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)  # TrainingArguments exports some: each case starts clean
    plan = _plan(strategy, ac)
    emitted = emit(plan, "hf-trainer")
    fields = json.loads(emitted.main)
    with warnings_as_errors("transformers", "accelerate") as logged:
        args = _training_arguments(fields, tmp_path)
    s = plan.strategy
    expected = []
    if s.kind == "fsdp":
        expected.append(FSDP1_DEPRECATED)
        assert any("deprecates FSDP1" in note for note in emitted.notes)
    if s.kind in ("fsdp", "fsdp2") and fields.get("activation_checkpointing"):
        expected.append(REDUNDANT_ALLGATHER)
        assert any("redundant all-gather" in note for note in emitted.notes)
    assert sorted(m for m in logged if any(e in m for e in expected)) == sorted(logged), logged
    assert all(any(e in m for m in logged) for e in expected), (expected, logged)  # the check can fail
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    if s.is_deepspeed:
        checked = args.hf_deepspeed_config  # HF's comparison of the JSON with the other arguments
        assert checked.config["zero_optimization"]["stage"] == int(s.kind[4]) and checked.mismatches == []
    if s.kind not in ("fsdp", "fsdp2"):
        assert not args.fsdp and not args.fsdp_plugin_args
        return
    ignored = _ignored_fsdp_keys(fields, args, tmp_path)
    assert not ignored, f"transformers ignores fsdp_config keys {ignored}"
    # What the Trainer builds from them (trainer.py: FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)).
    from accelerate.utils import FullyShardedDataParallelPlugin

    with warnings_as_errors("accelerate") as plugin_logged:
        if s.kind == "fsdp":
            # FSDP1's cpu_ram_efficient_loading needs sync_module_states, which accelerate runs on GPUs only:
            # the plugin refusing it on this CPU machine is the proof the key reached it.
            with pytest.raises(RuntimeError, match="sync_module_states=True. is not supported on cpu"):
                FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
            return
        plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    assert plugin_logged == []
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward == s.reshard_after_forward
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    from torch.distributed.fsdp import CPUOffloadPolicy

    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == bool(s.offload_params)
    assert plugin.activation_checkpointing == (ac == "full")


# ---- Lightning ----------------------------------------------------------------------------------
def _lightning(strategy: str, precision: str = "bf16", ac: str = "full", nodes: int = 2):
    plan = make(strategy, model=BIG, nodes=1 if strategy == "single" else nodes, gpus=1 if strategy == "single" else 4,
                ac=ac, precision=precision)
    text = emit(plan, "lightning").main
    head, _, _ = text.partition("trainer = L.Trainer(")
    return plan, text, head


def _trainer(text: str):
    # The emitted Trainer call on this machine's CPU; logger=False: the default logger's warning about
    # tensorboardX is about this environment, not the emitted arguments.
    cpu = text.replace('accelerator="gpu"', 'accelerator="cpu"').replace("trainer = L.Trainer(",
                                                                          "trainer = L.Trainer(logger=False,")
    namespace: dict = {}
    exec(compile(cpu, "lightning_strategy.py", "exec"), namespace)
    return namespace["trainer"]


LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "deepspeed", "DeepSpeed")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_lightning_strategy_takes_every_emitted_argument_without_warnings(strategy, precision):
    from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy,
                                              SingleDeviceStrategy)

    plan, text, head = _lightning(strategy, precision)
    s = plan.strategy
    namespace: dict = {}
    with warnings_as_errors(*LIGHTNING_LOGGERS) as logged:
        exec(compile(head, "lightning_strategy.py", "exec"), namespace)
        built = namespace["strategy"]
        if s.kind == "fsdp":
            assert isinstance(built, FSDPStrategy) and built.sharding_strategy.name == s.sharding.upper()
            assert built.cpu_offload.offload_params == bool(s.offload_params)
            # What FSDPStrategy does not take itself goes to torch's FullyShardedDataParallel at wrap
            # time (no GPU here to wrap): each such key must be one of its parameters.
            from torch.distributed.fsdp import FullyShardedDataParallel

            accepted = inspect.signature(FullyShardedDataParallel.__init__).parameters
            assert set(built.kwargs) <= set(accepted), set(built.kwargs) - set(accepted)
            assert logged == []
            return  # Lightning's Trainer refuses FSDP without a GPU
        trainer = _trainer(text)
    assert logged == [], logged
    expected = {"single": SingleDeviceStrategy, "ddp": DDPStrategy, "fsdp2": ModelParallelStrategy}.get(
        s.kind, DeepSpeedStrategy)
    assert isinstance(trainer.strategy, expected)
    assert trainer.accumulate_grad_batches == plan.training.grad_accum
    assert (trainer.num_nodes, trainer.num_devices) == ((1, 1) if s.kind == "single" else (2, 4))
    if s.is_deepspeed:
        _check_lightning_deepspeed_config(trainer, plan)


def _check_lightning_deepspeed_config(trainer, plan):
    """Lightning's own formatting of the config, as at fit (it refuses keys the Trainer owns), then
    DeepSpeed's parser on the result."""
    import lightning as L
    from deepspeed.runtime.config import DeepSpeedConfig

    module = L.LightningModule()
    module.trainer = trainer
    trainer.strategy.connect(module)
    with warnings_as_errors(*LIGHTNING_LOGGERS) as logged:
        trainer.strategy._init_config_if_needed()  # private, but it is what DeepSpeedStrategy.setup runs
    assert logged == []
    config = trainer.strategy.config
    assert config["gradient_accumulation_steps"] == plan.training.grad_accum  # from accumulate_grad_batches
    assert config["zero_optimization"]["stage"] == int(plan.strategy.kind[4])
    one_rank = dict(config, train_batch_size=config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"])
    parsed = DeepSpeedConfig(one_rank)  # one process here: world size 1
    assert parsed.zero_optimization_stage == int(plan.strategy.kind[4])


def test_lightning_refuses_what_the_check_above_looks_for():
    """The DeepSpeed check can fail: Lightning's formatting refuses the accumulation in the config."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    plan, text, _ = _lightning("zero2", "bf16")
    trainer = _trainer(text)
    trainer.strategy.config["gradient_accumulation_steps"] = plan.training.grad_accum
    with pytest.raises(MisconfigurationException, match="gradient_accumulation_steps"):
        _check_lightning_deepspeed_config(trainer, plan)


def test_every_strategy_is_covered():
    kinds = {parse_strategy(s).kind for s in STRATEGIES}
    assert kinds == {"single", "ddp", "fsdp", "fsdp2", "zero1", "zero2", "zero3"}
