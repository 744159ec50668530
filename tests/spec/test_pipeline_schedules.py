"""The pipeline estimate's in-flight counts against torch's own schedules: torch.distributed.pipelining
builds every rank's action list (F, B, and under the zero-bubble schedules I and W) when a schedule is
constructed; walking a rank's list gives the chunk micro-batches whose activations are alive (F to B,
or F to W) and those waiting for their weight gradient (I to W). spec/parallelism.py's closed forms
(torch-free, what plan and fit use) must equal that walk for every valid layout in the grid."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardfit.errors import ShardfitError
from shardfit.spec.models import load_model_spec
from shardfit.spec.parallelism import (MULTI_CHUNK_SCHEDULES, SPLIT_BACKWARD_SCHEDULES, TORCH_SCHEDULES,
                                       Parallelism, in_flight_microbatches, rank_chunks, resolve,
                                       split_backward_points, validate_parallelism)
from shardfit.spec.plan import Cluster, Plan, Training, parse_strategy

pytest.importorskip("torch")
MODEL = load_model_spec("llama-3.1-405b")  # 126 layers: room for every chunk count below


def _plan(schedule: str, pp: int, virtual: int, micro: int) -> Plan:
    return Plan(model=MODEL, strategy=parse_strategy("fsdp2"), cluster=Cluster(nodes=pp, gpus_per_node=8),
                training=Training(seq_len=8192, grad_accum=micro),
                parallelism=Parallelism(tp=8, pp=pp, pp_schedule=schedule, pp_virtual_stages=virtual))


def _action_lists(schedule: str, pp: int, virtual: int, micro: int) -> dict:
    """torch's pipeline_order for every rank, from rank 0's point of view: stand-in stages carry only
    what the schedule's constructor reads; the communication pass (which needs real stages) is skipped."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, TORCH_SCHEDULES[schedule])
    stages = [SimpleNamespace(num_stages=pp * virtual, group_size=pp, group_rank=0, stage_index=k,
                              is_first=k == 0, is_last=k == pp * virtual - 1, submod=None)
              for k in rank_chunks(0, pp, virtual, schedule)]
    runtime = schedules._PipelineScheduleRuntime
    original = runtime._prepare_schedule_with_comms
    runtime._prepare_schedule_with_comms = lambda self, *args, **kwargs: None
    try:
        return cls(stages, n_microbatches=micro, loss_fn=lambda output, target: output).pipeline_order
    finally:
        runtime._prepare_schedule_with_comms = original


def _actions(action):
    if action.sub_actions:  # DualPipeV's overlapped forward + backward: the forward first
        for sub in action.sub_actions:
            yield from _actions(sub)
    else:
        yield action


def _walk(actions) -> dict:
    """{"forward": instants after each F, "backward": instants at each I / B / W} as (alive, waiting),
    each reduced to its frontier (no other instant of the phase holds more of both)."""
    alive = waiting = 0
    points = {"forward": set(), "backward": set()}
    for action in filter(None, actions):
        for one in _actions(action):
            kind = one.computation_type.name
            if kind == "FORWARD":
                alive += 1
                points["forward"].add((alive, waiting))
            elif kind == "BACKWARD_INPUT":
                waiting += 1
                points["backward"].add((alive, waiting))
            elif kind in ("FULL_BACKWARD", "BACKWARD_WEIGHT"):
                points["backward"].add((alive, waiting))
                alive -= 1
                waiting -= kind == "BACKWARD_WEIGHT"
    return {phase: sorted(p for p in pts if not any(q != p and q[0] >= p[0] and q[1] >= p[1] for q in pts))
            for phase, pts in points.items()}


def _grid():
    for schedule in MULTI_CHUNK_SCHEDULES:
        for pp in (2, 3, 4, 8):
            for virtual in ((2,) if schedule in ("zbv", "dualpipev") else (1, 2, 3)):
                if schedule == "interleaved" and virtual == 1:
                    continue
                for micro in range(1, 4 * pp + 1):
                    plan = _plan(schedule, pp, virtual, micro)
                    try:
                        validate_parallelism(plan)
                    except ShardfitError:
                        continue  # a layout shardfit refuses in one line
                    yield schedule, pp, virtual, micro


GRID = list(_grid())


def test_the_grid_covers_every_multi_chunk_schedule():
    assert {g[0] for g in GRID} == set(MULTI_CHUNK_SCHEDULES) and len(GRID) > 100


@pytest.mark.parametrize("schedule,pp,virtual,micro", GRID)
def test_in_flight_equals_torchs_action_lists(schedule, pp, virtual, micro):
    lists = _action_lists(schedule, pp, virtual, micro)
    layout = resolve(_plan(schedule, pp, virtual, micro))
    for rank in range(pp):
        walked = _walk(lists[rank])
        most = max(alive for alive, _ in walked["forward"] + walked["backward"])
        assert in_flight_microbatches(layout, rank) * virtual == pytest.approx(most), (rank, walked)
        if schedule in SPLIT_BACKWARD_SCHEDULES:
            for phase in ("forward", "backward"):
                assert sorted(split_backward_points(layout, rank, phase)) == walked[phase], (rank, phase)
