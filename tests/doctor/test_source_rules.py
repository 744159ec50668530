"""Each source rule: a script that triggers it and one that doesn't. Scripts are parsed, never run."""
import textwrap

import pytest

from shardfit.doctor.diagnose import diagnose
from shardfit.doctor.rules import Context
from shardfit.errors import ShardfitError
from shardfit.spec.gpus import get_gpu


def findings(tmp_path, source, name="train.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return {f.rule: f for f in diagnose([str(path)], Context()).findings}


def test_optimizer_before_fully_shard(tmp_path):
    bad = """
        import torch
        from torch.distributed.fsdp import fully_shard
        def main(model):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
        """
    finding = findings(tmp_path, bad)["optimizer-before-shard"]
    assert finding.severity == "error" and finding.where.endswith("train.py:5")
    good = """
        import torch
        from torch.distributed.fsdp import fully_shard
        def main(model):
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        """
    assert "optimizer-before-shard" not in findings(tmp_path, good)


def test_fsdp_without_auto_wrap_in_source(tmp_path):
    assert "fsdp-no-auto-wrap" in findings(tmp_path, "model = FSDP(model, device_id=0)\n")
    assert "fsdp-no-auto-wrap" not in findings(tmp_path, "model = FSDP(model, auto_wrap_policy=policy)\n")
    assert "fsdp-no-auto-wrap" in findings(tmp_path, "fully_shard(model)\n")
    assert "fsdp-no-auto-wrap" not in findings(tmp_path, "for b in model.layers:\n    fully_shard(b)\nfully_shard(model)\n")


def test_empty_cache_every_step(tmp_path):
    bad = """
        import torch
        for batch in loader:
            loss = model(batch).loss
            loss.backward()
            torch.cuda.empty_cache()
        """
    assert findings(tmp_path, bad)["empty-cache-every-step"].where.endswith(":6")
    assert "empty-cache-every-step" not in findings(tmp_path, "import torch\ntrain()\ntorch.cuda.empty_cache()\n")


def test_rank_dependent_global_seed(tmp_path):
    bad = "import torch, torch.distributed as dist\ntorch.manual_seed(1234 + dist.get_rank())\n"
    assert findings(tmp_path, bad)["rank-dependent-rng"].severity == "warning"
    # A per-rank generator for data is the right way: global RNG shared, data RNG per rank.
    good = ("import torch\ntorch.manual_seed(1234)\n"
            "gen = torch.Generator().manual_seed(1234 + rank)\nx = torch.randint(0, 10, (4,), generator=gen)\n")
    assert not {"rank-dependent-rng", "unseeded-rng"} & set(findings(tmp_path, good))


def test_unseeded_random_augmentation(tmp_path):
    bad = "import random\ndef augment(x):\n    return x if random.random() < 0.5 else x[::-1]\n"
    assert "unseeded-rng" in findings(tmp_path, bad)
    assert "unseeded-rng" not in findings(tmp_path, "import random\nrandom.seed(0)\n" + bad.split("\n", 1)[1])


def test_use_cache_with_gradient_checkpointing(tmp_path):
    bad = "model.gradient_checkpointing_enable()\n"
    assert findings(tmp_path, bad)["use-cache-with-checkpointing"].severity == "error"
    explicit = "model = load(use_cache=True)\nmodel.gradient_checkpointing_enable()\n"
    assert "use-cache-with-checkpointing" in findings(tmp_path, explicit)
    good = "model.gradient_checkpointing_enable()\nmodel.config.use_cache = False\n"
    assert "use-cache-with-checkpointing" not in findings(tmp_path, good)


def test_device_from_global_rank(tmp_path):
    bad = "import torch, torch.distributed as dist\ntorch.cuda.set_device(dist.get_rank())\n"
    assert "device-from-global-rank" in findings(tmp_path, bad)
    good = "import os, torch\ntorch.cuda.set_device(int(os.environ['LOCAL_RANK']))\n"
    assert "device-from-global-rank" not in findings(tmp_path, good)


def test_fp16_autocast_without_grad_scaler(tmp_path):
    bad = "import torch\nwith torch.autocast('cuda', dtype=torch.float16):\n    loss = model(x)\nloss.backward()\n"
    assert findings(tmp_path, bad)["fp16-no-loss-scaling"].where.endswith(":2")
    good = "scaler = torch.amp.GradScaler('cuda')\n" + bad.replace("loss.backward()", "scaler.scale(loss).backward()")
    assert "fp16-no-loss-scaling" not in findings(tmp_path, good)
    assert "fp16-no-loss-scaling" not in findings(tmp_path, bad.replace("float16", "bfloat16"))


def test_unreadable_inputs_are_one_line_errors(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(ShardfitError, match="not valid Python"):
        diagnose([str(broken)])
    odd = tmp_path / "odd.json"
    odd.write_text('{"hello": 1}')
    with pytest.raises(ShardfitError, match="can't tell what this is"):
        diagnose([str(odd)])
    with pytest.raises(ShardfitError, match="no such file"):
        diagnose([str(tmp_path / "missing.json")])
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(ShardfitError, match="not valid JSON"):
        diagnose([str(bad_json)])


def test_the_seed_articles_fsdp_example_is_diagnosed(tmp_path):
    """The Romanian article's example: global rank as device, no seed; the Polish one wraps with a policy."""
    source = """
        import functools, torch, torch.distributed as dist
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
        dist.init_process_group(backend="nccl")
        torch.cuda.set_device(dist.get_rank())
        model = ModelTransformerMare().to(dist.get_rank())
        politica_wrap = functools.partial(size_based_auto_wrap_policy, min_num_params=1e6)
        fsdp_model = FSDP(model, auto_wrap_policy=politica_wrap, sharding_strategy=ShardingStrategy.FULL_SHARD,
                          device_id=torch.cuda.current_device())
        optimizator = torch.optim.AdamW(fsdp_model.parameters(), lr=1e-5)
        """
    found = findings(tmp_path, source)
    assert "device-from-global-rank" in found
    assert "fsdp-no-auto-wrap" not in found and "optimizer-before-shard" not in found


def test_what_emit_writes_passes_the_doctor(tmp_path):
    """Dogfood: the scripts and configs shardfit emits trigger no error or warning."""
    from shardfit.emit import emit
    from shardfit.spec.models import load_model_spec
    from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

    model = load_model_spec("llama-3.1-8b")
    for strategy, fmt, name in (("fsdp2", "fsdp2", "a.py"), ("fsdp", "fsdp", "b.py"), ("fsdp2", "accelerate", "c.yaml"),
                                ("zero2", "deepspeed", "d.json"), ("fsdp2", "hf-trainer", "e.json")):
        plan = Plan(model=model, strategy=parse_strategy(strategy),
                    training=Training(micro_batch=1, grad_accum=8, seq_len=8192, activation_checkpointing="full"),
                    cluster=Cluster(nodes=1, gpus_per_node=8))
        path = tmp_path / name
        path.write_text(emit(plan, fmt).main)
        report = diagnose([str(path)], Context(model=model, gpu=get_gpu("H100-80GB"), gpus_per_node=8, seq_len=8192))
        assert [f for f in report.findings if f.severity != "info"] == [], (name, report.findings)
