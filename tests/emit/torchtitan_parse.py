"""Run by tests/emit/test_emit_torchtitan.py with .venv/torchtitan-loader on PYTHONPATH: parse each case's
arguments with torchtitan's own ConfigManager (its config_registry function, then tyro over the
overrides, then Trainer.Config's own checks) and build ParallelDims for the world size, as
`torchtitan.train` does before it touches a GPU. Writes one JSON result per case.

argv: CASES.json OUT.json, CASES = [{"world": int | None, "args": [str, ...]}, ...]."""
import contextlib
import io
import json
import logging
import sys

logging.disable(logging.WARNING)

from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402


def parse(case):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            config = ConfigManager().parse_args(case["args"])
            # world None: only the config (the registry rows, whose own layouts want their own world)
            dims = ParallelDims.from_config(config.parallelism, case["world"]) if case["world"] else None
    except BaseException as exc:  # tyro exits (SystemExit) on a bad flag; ParallelDims asserts
        return {"ok": False, "error": f"{type(exc).__name__}: {exc} {err.getvalue()[:2000]}"}
    p, t = config.parallelism, config.training
    ac = config.activation_checkpoint
    return {"ok": True,
            "dims": dims and {name: getattr(dims, name) for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")},
            "parallelism": {"sequence_parallel": p.enable_sequence_parallel, "schedule": p.pipeline_parallel_schedule,
                            "microbatch_size": p.pipeline_parallel_microbatch_size,
                            "parts": p.module_fqns_per_model_part, "reshard": p.fsdp_reshard_after_forward},
            "training": {"local_batch_size": t.local_batch_size, "global_batch_size": t.global_batch_size,
                         "seq_len": t.seq_len, "steps": t.steps, "dtype": t.dtype, "param": t.mixed_precision_param,
                         "cpu_offload": t.enable_cpu_offload, "max_norm": t.max_norm},
            "ac": None if ac is None else type(ac).__qualname__.split(".")[0],
            "optimizer": config.optimizer.implementation,
            "loss_chunks": getattr(config.loss, "num_chunks", None),
            "checkpoint": [config.checkpoint.enable, config.checkpoint.interval],
            "model": _architecture(config.model_spec.model)}


def _architecture(model):
    """The shape fields TITAN_MODELS records, read off the registry's model config."""
    block = model.layers[-1]  # the last block: MoE where a model mixes dense and MoE blocks
    attention = block.attention
    moe = getattr(block, "moe", None)
    feed_forward = getattr(block, "feed_forward", None)
    return {"hidden": model.dim, "layers": len(model.layers), "heads": attention.n_heads,
            "kv_heads": getattr(attention, "n_kv_heads", None) or attention.n_heads, "vocab": model.vocab_size,
            "intermediate": feed_forward.w1.out_features if moe is None and feed_forward is not None else 0,
            "experts": moe.num_experts if moe is not None else 0}


def main():
    cases = json.load(open(sys.argv[1]))
    json.dump([parse(case) for case in cases], open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
