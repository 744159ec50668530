"""Run under torchrun: `run_emitted.py SCRIPT` runs an emitted training script's main() unchanged and,
from outside it, records what the tests check; each rank writes REPORT_DIR/report-RANK.json at the end.

- comm: every collective, counted as `shardfit bench` counts it (bench/comm.py's CommCounter at the
  dispatcher), with an event at each forward of the wrapped model (a micro-batch starts) and after
  each optimizer step, so a test sees how many reduce-scatters each micro-batch issued.
- rss: the process's resident memory (VmRSS) before the model is built and its peak (VmHWM) right
  after the script's parallelize() + materialisation (and load_weights, when it runs) returned.
- tied: whether the input embedding and the head share one weight after materialisation.
"""
import importlib.util
import json
import os
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from shardfit.bench.comm import CommCounter


def _status(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    spec = importlib.util.spec_from_file_location("emitted", sys.argv[1])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)  # its own imports (torch, transformers) happen here, before the baseline
    import transformers  # noqa: F401 - loaded before the baseline: the build imports it lazily

    report = {"events": [], "rss_before_build": 0, "peak_after_load": 0, "tied": None}
    counter = CommCounter()
    roots = []

    def mark(kind):
        report["events"].append([kind, counter.calls.get("reduce_scatter", 0), counter.calls.get("all_reduce", 0)])

    def on_forward(module, args):
        if roots and module is roots[0]:
            mark("forward")

    def loaded(model):
        report["peak_after_load"] = _status("VmHWM")
        inner = getattr(model, "module", model)  # DDP's and FSDP1's wrapped model; FSDP2 wraps in place
        embedding, head = inner.get_input_embeddings(), inner.get_output_embeddings()
        report["tied"] = head is not None and embedding.weight is head.weight
        roots[:] = [model]

    build, shard = script.build_model, script.parallelize

    def build_model():
        report["rss_before_build"] = _status("VmRSS")
        return build()

    def traced_shard(*args, **kwargs):
        model = shard(*args, **kwargs)
        loaded(model)
        return model

    script.build_model, script.parallelize = build_model, traced_shard
    if hasattr(script, "load_weights"):
        load = script.load_weights

        def traced_load(model, path):
            load(model, path)
            if roots:  # FSDP: loaded into the sharded model (DDP loads before wrapping)
                loaded(roots[0])
        script.load_weights = traced_load
    torch.nn.modules.module.register_module_forward_pre_hook(on_forward)
    register_optimizer_step_post_hook(lambda *_: mark("step"))
    rank = int(os.environ.get("RANK", "0"))
    # The script ends a CPU run with os._exit(0) (see SCRIPT_FINISH): here that returns, so the report is
    # written, and this process ends the same way after it.
    leave = os._exit
    os._exit = _finished
    try:
        with counter:
            script.main()
    except _Finished:
        pass
    finally:
        os._exit = leave
    # A file per rank: two ranks printing at once can interleave on one stdout line.
    with open(os.path.join(os.environ["REPORT_DIR"], f"report-{rank}.json"), "w") as handle:
        json.dump({"rank": rank, **report}, handle)
    sys.stdout.flush()
    sys.stderr.flush()
    leave(0)


class _Finished(Exception):
    pass


def _finished(code):
    raise _Finished(code)


def micro_batch_counts(events: list, index: int = 1) -> list[list[int]]:
    """Per optimizer step, the collectives of kind `index` (1 reduce-scatter, 2 all-reduce) issued from
    the start of each micro-batch's forward to the start of the next one (the last: to the step)."""
    steps, current, last = [], [], None
    for kind, *counts in events:
        value = counts[index - 1]
        if last is not None:
            current.append(value - last)
        last = value
        if kind == "step":
            steps.append(current)
            current, last = [], None
    return steps


if __name__ == "__main__":
    main()
