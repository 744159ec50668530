"""`shardfit train` refuses a layout its loop does not run (cp, ep; tp outside FSDP2;
pp with what the pipeline engine does not run) with one line, before it writes anything."""
import pytest

from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.parallelism import Parallelism
from shardfit.spec.plan import Cluster, Plan, parse_strategy

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("strategy,parallelism,words", [
    ("fsdp2", Parallelism(cp=2), "cp is for plan"),
    ("zero2", Parallelism(pp=2), "pipeline-parallel training runs its stages under"),
    ("ddp", Parallelism(tp=2), "runs under fsdp2"),
])
def test_train_refuses_layouts_it_does_not_run(tmp_path, strategy, parallelism, words):
    from shardfit.engines.base import DistContext
    from shardfit.train.loop import train

    plan = Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy(strategy),
                cluster=Cluster(nodes=1, gpus_per_node=4), parallelism=parallelism)
    ctx = DistContext(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ShardfitError, match=words) as info:
        train(plan, tmp_path / "run", ctx=ctx)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


def test_pipeline_engine_refuses_what_it_does_not_run_in_one_line():
    from shardfit.engines.base import DistContext
    from shardfit.engines.pipeline import check
    from shardfit.modeling import build_model

    model = build_model(load_model_spec("tiny-llama").source, device="cpu", dtype=None, seed=0)
    plan = Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy("fsdp2"),
                cluster=Cluster(nodes=1, gpus_per_node=4), parallelism=Parallelism(tp=2, pp=2))
    ctx = DistContext(rank=0, world_size=4, local_rank=0, device=torch.device("cpu"), backend="gloo")
    # tp (+ sequence parallel) inside a stage with the vocab-parallel loss runs (tests/engines/test_pipeline.py)
    check(plan.with_changes(parallelism=Parallelism(tp=2, pp=2, sequence_parallel=True)), model, ctx)
    ring = Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy("fsdp2"),
                cluster=Cluster(nodes=1, gpus_per_node=4), parallelism=Parallelism(cp=2, pp=2))
    with pytest.raises(ShardfitError, match="runs pp x dp x tp"):
        check(ring, model, ctx)
    zero = Plan(model=load_model_spec("tiny-llama"), strategy=parse_strategy("zero1"),
                cluster=Cluster(nodes=1, gpus_per_node=4), parallelism=Parallelism(pp=2))
    with pytest.raises(ShardfitError, match="runs under ddp or fsdp2"):
        check(zero, model, ctx)  # data parallel inside a stage: DDP or FSDP2 only
