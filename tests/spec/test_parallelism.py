"""The Plan's parallelism section: defaults are today's plans, round trips, the layout, and every
invalid layout's one-line error."""
import json

import pytest

from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.parallelism import (Parallelism, chunk_rank, holds_edges, in_flight_microbatches, rank_chunks,
                                       resolve, stage_layers)
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy, plan_from_dict, validate_plan
from shardfit.spec.planfile import dump_plan, load_plan

LLAMA = load_model_spec("llama-3.1-405b")
BIG = Cluster(nodes=64, gpus_per_node=8)


def plan(strategy="fsdp2", cluster=BIG, training=None, model=LLAMA, **par):
    return Plan(model=model, strategy=parse_strategy(strategy), cluster=cluster,
                training=training or Training(seq_len=8192), parallelism=Parallelism(**par))


def test_default_section_is_left_out_so_old_plans_and_hashes_are_unchanged(tmp_path):
    old = Plan(model=LLAMA)
    assert "parallelism" not in old.to_dict()
    for name in ("p.yaml", "p.json"):
        path = dump_plan(old, tmp_path / name)
        assert "parallelism" not in path.read_text()
        assert load_plan(path) == old


def test_section_round_trips_through_yaml_and_json(tmp_path):
    layout = plan(tp=8, pp=8, sequence_parallel=True, pp_schedule="interleaved", pp_virtual_stages=2,
                  pp_microbatches=16)
    assert layout.to_dict()["parallelism"]["tp"] == 8
    for name in ("p.yaml", "p.json"):
        assert load_plan(dump_plan(layout, tmp_path / name)) == layout
    again = plan_from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout


def test_unknown_field_is_one_line():
    with pytest.raises(ShardfitError, match="unknown field 'parallelism.tensor'"):
        plan_from_dict({"model": LLAMA.to_dict(), "parallelism": {"tensor": 8}})


def test_dp_is_derived_from_the_strategy():
    assert resolve(plan(tp=8, pp=8)).dp_shard == 8  # fsdp2 shards its 8 dp ranks
    ddp = resolve(plan("ddp", tp=8, pp=8))
    assert (ddp.dp_replicate, ddp.dp_shard) == (8, 1)
    hsdp = resolve(plan(tp=8, dp_shard=4))
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.tp) == (16, 4, 8)


def test_uneven_layers_go_to_the_middle_stages():
    assert stage_layers(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    assert stage_layers(126, 16) == (7,) + (8,) * 14 + (7,)  # Llama 3's own 16-stage split
    assert stage_layers(32, 4, 2) == (8, 8, 8, 8)
    assert sum(stage_layers(105, 35)) == 105
    # A V (ZB-V, DualPipeV): rank r holds chunks r and 2p - 1 - r, so the two middle chunks (which take
    # the extra layers) both sit on the last rank: 10 layers in 8 chunks (1,1,1,2,2,1,1,1).
    assert stage_layers(10, 4, 2, "zbv") == (2, 2, 2, 4)
    assert [rank_chunks(r, 4, 2, "zbv") for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_rank(k, 4, 2, "dualpipev") for k in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert holds_edges(0, 4, 2, "zbv") == (True, True) and holds_edges(3, 4, 2, "interleaved") == (False, True)


def test_in_flight_microbatches_per_schedule():
    one = resolve(plan(tp=8, pp=8, training=Training(seq_len=8192, grad_accum=16)))
    assert [in_flight_microbatches(one, i) for i in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    few = resolve(plan(tp=8, pp=8, training=Training(seq_len=8192, grad_accum=4)))
    assert in_flight_microbatches(few, 0) == 4
    inter = resolve(plan(tp=8, pp=8, pp_schedule="interleaved", pp_virtual_stages=2, pp_microbatches=16))
    # Korthikanti et al. sec. 4.2.3: p * (1 + (p-1)/(p*v)) on the first rank.
    assert in_flight_microbatches(inter, 0) == pytest.approx(8 * (1 + 7 / 16))
    gpipe = resolve(plan(tp=8, pp=8, pp_schedule="gpipe", pp_microbatches=16))
    assert in_flight_microbatches(gpipe, 7) == 16


BAD = [
    (dict(tp=3), "does not divide the world size 512"),
    (dict(tp=16), "must divide the 8 GPUs of one node"),
    (dict(tp=8, dp_replicate=3, dp_shard=2), "make dp_replicate x dp_shard = 64"),
    (dict(tp=8, dp_shard=3), "dp_shard = 3 does not divide the 64"),
    (dict(sequence_parallel=True), "needs tp > 1"),
    (dict(cp=4, tp=2), None),  # valid: 8192 % 8 == 0
    (dict(pp=8, pp_schedule="interleaved"), "pp_virtual_stages >= 2"),
    (dict(pp=8, pp_virtual_stages=2), "needs a schedule with several chunks per rank"),
    (dict(pp=8, pp_schedule="zbv", pp_microbatches=16), "exactly 2 chunks per rank"),
    (dict(pp=8, pp_schedule="zbv", pp_virtual_stages=2, pp_microbatches=14), "at least 15"),
    (dict(pp=8, pp_schedule="zbv", pp_virtual_stages=2, pp_microbatches=15), None),
    (dict(pp=8, pp_schedule="dualpipev", pp_virtual_stages=2, pp_microbatches=15), "at least 16"),
    (dict(pp=8, pp_schedule="zero-bubble", pp_microbatches=17), "rounds of pp"),  # torch: 2 rounds of 8.5
    (dict(pp=8, pp_schedule="zero-bubble", pp_microbatches=12), None),  # one round of 12
    (dict(pp=8, pp_schedule="zero-bubble", pp_microbatches=4), None),  # one round of 4 (a warning)
    (dict(pp=8, pp_schedule="zero-bubble", pp_virtual_stages=2, pp_microbatches=4), "rounds of pp"),
    (dict(pp=8, pp_schedule="zigzag"), "pp_schedule 'zigzag' is not known"),
    (dict(pp=8, pp_schedule="interleaved", pp_virtual_stages=2, pp_microbatches=12), "multiple of pp = 8"),
    (dict(pp=64, pp_virtual_stages=2, pp_schedule="interleaved", pp_microbatches=64), "128 chunks but"),
    (dict(pp=8, pp_microbatches=4), "Schedule1F1B refuses fewer"),
    (dict(pp=8, pp_schedule="gpipe", pp_microbatches=4), None),  # valid (a warning): GPipe runs any count
    (dict(ep=2), "dense model"),
    (dict(tp=0), "parallelism.tp must be at least 1"),
]


@pytest.mark.parametrize("par,message", BAD)
def test_invalid_layouts_are_one_line(par, message):
    candidate = plan(**par)
    if message is None:
        validate_plan(candidate)
        return
    with pytest.raises(ShardfitError, match=message.replace("(", r"\(").replace(")", r"\)")) as info:
        validate_plan(candidate)
    assert "\n" not in str(info.value)


def test_heads_kv_heads_and_sequence_rules():
    small = Cluster(nodes=1, gpus_per_node=8)
    tiny = load_model_spec("tiny-llama")
    heads = tiny.num_kv_heads or tiny.num_heads
    bad_tp = next(t for t in (8, 4, 2) if heads % t or tiny.num_heads % t)
    with pytest.raises(ShardfitError, match="must divide the attention heads"):
        validate_plan(plan(model=tiny, cluster=small, training=Training(seq_len=256), tp=bad_tp))
    with pytest.raises(ShardfitError, match="divisible by 8"):
        validate_plan(plan(cluster=small, training=Training(seq_len=8188), cp=4, tp=2))
    with pytest.raises(ShardfitError, match="divisible by tp = 8"):
        validate_plan(plan(cluster=small, training=Training(seq_len=8188), tp=8, sequence_parallel=True))


def test_strategies_that_do_not_compose_are_refused():
    for kind in ("zero3", "zero2", "fsdp"):
        with pytest.raises(ShardfitError, match="does not compose with tp/cp/pp"):
            validate_plan(plan(kind, tp=8))
    validate_plan(plan("zero1", pp=8, training=Training(seq_len=8192, grad_accum=8)))
    with pytest.raises(ShardfitError, match="dp_shard must be 1"):
        validate_plan(plan("ddp", tp=8, dp_shard=8))


def test_few_microbatches_and_uneven_layers_warn():
    # GPipe runs fewer micro-batches than stages (a bubble over half the step); 1F1B refuses them (BAD).
    warnings = validate_plan(plan(tp=8, pp=8, pp_schedule="gpipe"))
    assert any("bubble" in w for w in warnings) and any("middle stages" in w for w in warnings)


def test_fsdp2_embedding_units_under_tp_stay_in_the_root():
    # The rank-local estimate keeps the vocab-sharded embedding and head in the root unit under tp > 1
    # (engines/fsdp2.py wraps them so): asking for separate units there is one line, auto is root.
    from dataclasses import replace

    from shardfit.estimate.estimator import estimate

    tp = plan(tp=8)
    separate = replace(tp, strategy=replace(tp.strategy, embedding_units="separate"))
    with pytest.raises(ShardfitError, match="not modelled under tensor parallelism"):
        validate_plan(separate)
    root = replace(tp, strategy=replace(tp.strategy, embedding_units="root"))
    assert estimate(tp).peak_bytes == estimate(root).peak_bytes
