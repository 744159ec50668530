"""gloo's worker thread must not decide when a collective's buffers die while the tracker measures
(shardfit/measure/collective_release.py): two real ranks reduce a buffer and drop it at once, the
pattern of a ZeRO bucket cleared right after its last reduction; where each buffer's storage dies
is counted, without the profiler (where the race shows) and inside it (where it must not)."""
from __future__ import annotations

import json

import pytest

from launch import test_env as launch_env, torchrun

pytestmark = pytest.mark.multirank

RANK_SCRIPT = r'''
import json, os, sys, threading, weakref
import torch, torch.distributed as dist
import shardfit
from torch._C._distributed_c10d import Work

dist.init_process_group("gloo")
rank = dist.get_rank()
main = threading.main_thread().ident
original_wait = Work.wait


def reduce_and_drop(count):
    died_elsewhere = []
    for _ in range(count):
        buffer = torch.ones(4096)
        weakref.finalize(buffer.untyped_storage(), lambda: died_elsewhere.append(threading.get_ident() != main))
        dist.all_reduce(buffer)
        del buffer
        sum(range(300))  # the program goes on with Python work, as an engine does
    dist.barrier()
    return sum(died_elsewhere), len(died_elsewhere)


bare = reduce_and_drop(300)
with shardfit.profile(torch.nn.Linear(4, 4)):
    patched = Work.wait is not original_wait
    measured = reduce_and_drop(300)
restored = Work.wait is original_wait
with open(os.environ["OUT"] + f"/rank{rank}.json", "w") as f:
    json.dump({"bare": bare, "measured": measured, "patched": patched, "restored": restored}, f)
dist.destroy_process_group()
'''


def test_a_reduced_buffer_dies_on_the_main_thread_while_measured(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    torchrun([str(script)], nproc=2, timeout=180, env=launch_env(OUT=str(tmp_path)), cwd=tmp_path)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert report["patched"] and report["restored"], report
        elsewhere, total = report["measured"]
        assert total == 300
        assert elsewhere == 0, f"{elsewhere} of 300 buffers died on gloo's worker thread while measured"
    # Without the profiler the race is real (28-47% of buffers on a 2-core VM). Where it never shows
    # (a core to spare for the worker thread), the check above proves nothing: say so.
    if sum(report["bare"][0] for report in reports) == 0:
        pytest.skip("gloo's worker thread never outlived the program here: the race did not show")
