"""The emitted accelerate.yaml goes the way `accelerate launch` takes it: the launch parser reads the
file, the launcher turns it into the environment the ranks get, and accelerate's own plugin objects
(FullyShardedDataParallelPlugin, DeepSpeedPlugin) are built from that environment."""
import logging
import os

import pytest
import yaml

from shardfit.emit import emit
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

BIG = load_model_spec("llama-3.1-8b")
FSDP2_DROPPED = ("fsdp_sync_module_states", "fsdp_use_orig_params")


def _launch_env(tmp_path, strategy, monkeypatch, nodes=1, gpus=8):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    plan = Plan(model=BIG, strategy=parse_strategy(strategy),
                training=Training(micro_batch=1, grad_accum=8, precision="bf16", activation_checkpointing="full"),
                cluster=Cluster(nodes=nodes, gpus_per_node=gpus, gpu="H100-80GB"))
    path = tmp_path / "accelerate.yaml"
    path.write_text(emit(plan, "accelerate").main)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:  # what launch_command sets before the DeepSpeed launcher
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    env = prepare_deepspeed_cmd_env(args)[1] if args.use_deepspeed else prepare_multi_gpu_env(args)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(key, value)
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp"])
def test_fsdp_plugin_builds_from_the_emitted_yaml(tmp_path, monkeypatch, caplog, strategy):
    from accelerate.utils import FullyShardedDataParallelPlugin

    config = _launch_env(tmp_path, strategy, monkeypatch)["fsdp_config"]
    if strategy == "fsdp":
        # FSDP1's cpu_ram_efficient_loading needs sync_module_states, which accelerate runs on GPUs only:
        # the plugin refusing it on this CPU machine is the proof the key reached it.
        assert config["fsdp_sync_module_states"] is True and config["fsdp_use_orig_params"] is True
        with pytest.raises(RuntimeError, match="sync_module_states=True. is not supported on cpu"):
            FullyShardedDataParallelPlugin()
        return
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's environment, as in a rank
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.cpu_ram_efficient_loading is True and plugin.activation_checkpointing is True
    assert not any(key in config for key in FSDP2_DROPPED)
    # The same keys as a user's FullyShardedDataParallelPlugin(...) call: FSDP2 must warn about none.
    renamed = {"fsdp_version": "fsdp_version", "fsdp_transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
               "fsdp_offload_params": "cpu_offload", "fsdp_auto_wrap_policy": "auto_wrap_policy"}
    kwargs = {renamed.get(key, key.removeprefix("fsdp_")): value for key, value in config.items()}
    kwargs["auto_wrap_policy"] = kwargs["auto_wrap_policy"].lower()
    kwargs["transformer_cls_names_to_wrap"] = [kwargs["transformer_cls_names_to_wrap"]]
    with caplog.at_level(logging.WARNING):
        FullyShardedDataParallelPlugin(**kwargs)
    assert "obsolete" not in caplog.text and "deprecat" not in caplog.text.lower()
    # The keys FSDP2 dropped do make it warn: the check above can fail.
    with caplog.at_level(logging.WARNING):
        FullyShardedDataParallelPlugin(**kwargs, sync_module_states=True)
    assert "obsolete" in caplog.text


@pytest.mark.parametrize("strategy,stage", [("zero3", 3), ("zero2", 2)])
def test_deepspeed_plugin_builds_from_the_emitted_yaml(tmp_path, monkeypatch, strategy, stage):
    from accelerate.utils import DeepSpeedPlugin

    config = _launch_env(tmp_path, strategy, monkeypatch)
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == stage == config["deepspeed_config"]["zero_stage"]
    assert plugin.gradient_accumulation_steps == 8
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == stage
    assert os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == str(stage)
