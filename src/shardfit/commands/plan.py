"""`shardfit plan`: memory per GPU by category and phase, one row per strategy. Parses and prints;
the numbers come from shardfit.estimate, the formatting from shardfit.estimate.report. No torch."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from shardfit.commands.kernel_flags import add_kernel_arguments, kernel_changes
from shardfit.commands.lora_flags import add_lora_arguments, lora_asked, lora_from_args, lora_line
from shardfit.commands.setup_flags import add_setup_arguments, plan_from_args, setup_paths
from shardfit.commands.parallel_flags import add_parallel_arguments, parallelism_from_args
from shardfit.errors import ShardfitError
from shardfit.estimate import parallel_report, report
from shardfit.estimate.estimator import ACCOUNTING, CHECKPOINT_MODES, DEVICES, estimate, OPTIMIZER_IMPLS
from shardfit.fit.parallel_time import step_time
from shardfit.spec.device_profile import load_profile
from shardfit.spec.gpus import get_gpu, split_gpus
from shardfit.spec.model_spec import params_only_spec
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import parse_strategy, Plan, validate_plan
from shardfit.spec.planfile import load_plan, read_plan_data

# single is listed only for a one-GPU cluster: everywhere else it is not a way to run the plan.
ALL_STRATEGIES = ("single", "ddp", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp:hybrid_shard", "fsdp:no_shard", "fsdp2",
                  "zero1", "zero2", "zero3", "zero2+offload", "zero3+offload")


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="a preset (see `shardfit models`), a config.json path or directory, a factory "
                             "pkg.module:fn, or a PLAN.yaml / PLAN.json")
    parser.add_argument("--params", type=float, default=None, help="states-only estimate for this many parameters (e.g. 7.5e9)")
    parser.add_argument("--largest-layer", type=float, default=None, help="with --params: the largest layer's parameters")
    parser.add_argument("--gpu", default=None, help="GPU model from the catalog, or custom:SIZE (custom:24 is GiB; custom:80GB); default H100-80GB")
    parser.add_argument("--gpus", type=int, default=None, help="total GPUs (default 8; nodes of 8 above 8 GPUs)")
    parser.add_argument("--nodes", type=int, default=None, help="nodes (GPUs per node = --gpus / --nodes)")
    parser.add_argument("--strategy", "--strategies", action="append", default=None, dest="strategy",
                        help="one or more (comma-separated or repeated): single (one GPU), ddp, fsdp:{full_shard,shard_grad_op,"
                             "hybrid_shard,no_shard}, fsdp2[:no_reshard], zero1, zero2, zero3, +offload; default all")
    parser.add_argument("--precision", default=None, help="fp32 | fp16 | bf16 (mixed, fp32 master) | bf16-pure")
    parser.add_argument("--optimizer", default=None, help="adamw | adamw8bit | sgd | lion | adafactor")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None, help="sequence length")
    parser.add_argument("--grad-accum", type=int, default=None)
    parser.add_argument("--ac", default=None, help="activation checkpointing: none | selective (per-op: matmul and attention outputs kept) | full | every-N")
    parser.add_argument("--attention", default=None, help="sdpa (flash, no s*s scores) | eager")
    add_lora_arguments(parser)
    add_setup_arguments(parser)
    add_parallel_arguments(parser)
    parser.add_argument("--offload", default=None, help="cpu | nvme: offload where each strategy can")
    parser.add_argument("--nvme-path", default=None, help="NVMe mount for --offload nvme")
    parser.add_argument("--shard-group-size", type=int, default=None, help="hybrid shard group size (default GPUs per node)")
    parser.add_argument("--accounting", default="real", help="real (default) | ideal (ZeRO paper) | deepspeed (its estimator)")
    parser.add_argument("--device", default="cuda", help="cuda (default) | cpu (no CUDA context/NCCL/margin; CPU optimizer)")
    add_kernel_arguments(parser)
    parser.add_argument("--checkpoint", default="sharded", help="checkpoint save: sharded (default) | full (rank-0 consolidation)")
    parser.add_argument("--device-profile", dest="device_profile",
                        help="also print each strategy's step time under the rates `shardfit calibrate` measured")
    parser.add_argument("--json", action="store_true", help="print the stable JSON document (schema: docs/estimator.md)")
    parser.add_argument("--explain", action="store_true", help="print every term's formula, inputs and source")


def _is_plan_file(ref: str) -> bool:
    path = Path(ref)
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return True
    if suffix == ".json" and path.is_file():
        return "model" in read_plan_data(path)
    return False


def _split_gpus(args, cluster):
    gpus, nodes = args.gpus, args.nodes
    if gpus is None and nodes is None:
        return cluster
    if nodes is not None and nodes < 1:
        raise ShardfitError(f"--nodes must be at least 1, got {nodes}")
    if gpus is None:
        return replace(cluster, nodes=nodes)
    nodes, per_node = split_gpus(gpus, nodes)
    return replace(cluster, nodes=nodes, gpus_per_node=per_node)


def build_plan(args):
    """The base Plan from MODEL / --params / PLAN file, with the flags applied on top."""
    if args.params is not None:
        if args.model is not None:
            raise ShardfitError("give either MODEL or --params, not both")
        plan = Plan(model=params_only_spec(args.params, args.largest_layer))
    elif args.model is None:
        raise ShardfitError("plan needs a MODEL (preset, config path, PLAN.yaml) or --params N")
    elif _is_plan_file(args.model):
        plan = load_plan(args.model)
    else:
        plan = Plan(model=load_model_spec(args.model))
    if args.largest_layer is not None and args.params is None:
        raise ShardfitError("--largest-layer only goes with --params")
    from_setup = plan_from_args(args, plan.model, base=plan, world_size=args.gpus, nodes=args.nodes, gpu=args.gpu,
                                seq_len=args.seq, micro_batch=args.micro_batch)
    if from_setup is not None:
        plan = from_setup.plan  # the setup's run; flags below still win
    t, c, s = plan.training, plan.cluster, plan.strategy
    changes = {k: v for k, v in (("precision", args.precision), ("optimizer", args.optimizer),
                                 ("micro_batch", args.micro_batch), ("seq_len", args.seq),
                                 ("grad_accum", args.grad_accum), ("activation_checkpointing", args.ac),
                                 ("attention", args.attention)) if v is not None}
    if args.precision is not None:
        changes["precision"] = args.precision.strip().lower()
    t = replace(t, **changes, **kernel_changes(args))
    t = replace(t, lora=lora_from_args(args, plan.model, t.lora))
    if args.gpu is not None:
        c = replace(c, gpu=args.gpu)
    c = _split_gpus(args, c)
    if args.shard_group_size is not None:
        s = replace(s, shard_group_size=args.shard_group_size)
    return replace(plan, training=t, cluster=c, strategy=s,
                   parallelism=parallelism_from_args(args, plan.parallelism))


def _with_offload(strategy, offload: str | None, nvme_path: str | None):
    if offload is None:
        return strategy
    device = offload.strip().lower()
    if device not in ("cpu", "nvme"):
        raise ShardfitError(f"--offload '{offload}': use cpu or nvme")
    path = nvme_path or strategy.nvme_path
    if strategy.kind in ("zero1", "zero2"):
        return replace(strategy, offload_optimizer=device, nvme_path=path)
    if strategy.kind == "zero3":
        return replace(strategy, offload_optimizer=device, offload_params=device, nvme_path=path)
    return replace(strategy, offload_params=device, nvme_path=path)


def no_valid_strategy(skipped: list[tuple[str, str]]) -> ShardfitError:
    """Every strategy was refused. The same reason for each is an error of the plan itself (a
    training or cluster field): said as such. Only reasons that differ are strategies' own."""
    reasons = list(dict.fromkeys(reason for _, reason in skipped))
    if len(reasons) == 1:
        return ShardfitError(f"invalid plan: {reasons[0]}")
    return ShardfitError("no strategy is valid for this plan: " + "; ".join(f"{label}: {reason}" for label, reason in skipped))


def strategies_for(args, plan):
    """[(strategy, explicit)]: the asked strategies, or every strategy (invalid ones get skipped)."""
    base = plan.strategy
    knobs = {f: getattr(base, f) for f in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
                                           "param_persistence_threshold", "max_live_parameters", "overlap_comm",
                                           "ddp_bucket_cap_mb", "ddp_gradient_as_bucket_view", "wrap_unit",
                                           "backward_prefetch",
                                           "shard_group_size")}
    if args.strategy:
        names = [n.strip() for item in args.strategy for n in item.split(",") if n.strip()]
        explicit = True
        if not names:
            raise ShardfitError("--strategy is empty: give one or more of single, ddp, fsdp, fsdp2, zero1, zero2, zero3 (comma-separated)")
    elif (args.model is not None and _is_plan_file(args.model)) or setup_paths(args):
        strategy = _with_offload(base, args.offload, args.nvme_path)
        if args.nvme_path:
            strategy = replace(strategy, nvme_path=args.nvme_path)
        return [(strategy, True)]
    else:
        names = [n for n in ALL_STRATEGIES if n != "single" or plan.cluster.world_size == 1]
        explicit = False
    out = []
    for name in names:
        strategy = replace(parse_strategy(name), **knobs)
        if "nvme" in name and args.nvme_path:
            strategy = replace(strategy, nvme_path=args.nvme_path)
        if "+offload" not in name:
            strategy = _with_offload(strategy, args.offload, args.nvme_path)
        out.append((strategy, explicit))
    return out


def run(args) -> int:
    for value, choices, flag in ((args.accounting, ACCOUNTING, "--accounting"), (args.device, DEVICES, "--device"),
                                 (args.checkpoint, CHECKPOINT_MODES, "--checkpoint")):
        if value not in choices:
            raise ShardfitError(f"{flag} '{value}' is not known: use one of {', '.join(choices)}")
    if args.offload and args.offload.strip().lower() == "nvme" and not args.nvme_path:
        raise ShardfitError("--offload nvme needs --nvme-path (a local NVMe mount, e.g. /local_nvme)")
    plan = build_plan(args)
    gpu = get_gpu(plan.cluster.gpu)
    profile = None
    if args.device_profile:
        profile = load_profile(args.device_profile).as_gpu(memory_gib=gpu.memory_gib)
    rows, skipped, times = [], [], {}
    for strategy, explicit in strategies_for(args, plan):
        candidate = replace(plan, strategy=strategy)
        try:
            warnings = validate_plan(candidate)
            est = estimate(candidate, accounting=args.accounting, device=args.device, checkpoint=args.checkpoint,
                           explain=True)
        except ShardfitError as exc:
            if explicit:
                raise
            skipped.append((strategy.label, str(exc)))
            continue
        if warnings:
            est = replace(est, warnings=tuple(warnings) + est.warnings)
        rows.append((strategy.label, est))
        if profile is not None:
            times[strategy.label] = _step_seconds(candidate, profile)
    if not rows:
        raise no_valid_strategy(skipped)
    layout_strategies = [s for s, _ in strategies_for(args, plan) if s.label in dict(rows)]
    options = {"accounting": args.accounting, "device": args.device, "checkpoint": args.checkpoint,
               "optimizer_impl": args.optimizer_impl}
    if args.json:
        doc = report.document(plan, gpu, rows, args.accounting, args.device, args.checkpoint, skipped,
                              with_terms=args.explain)
        if profile is not None:
            doc["step_time_s"] = {"device_profile": args.device_profile, **times}
        if not plan.parallelism.is_default:
            doc["parallelism"] = parallel_report.layout_document(plan, layout_strategies, estimate, options)
        sys.stdout.write(report.to_json(doc) + "\n")
        return 0
    print(report.table(plan, gpu, rows, args.accounting, args.device, skipped))
    if not plan.parallelism.is_default:
        print(parallel_report.layout_text(plan, layout_strategies, estimate, options, gpu.memory_gib))
    if lora_asked(args):
        print(f"note: {lora_line(plan.training.lora, args)}")
    if profile is not None:
        print(f"\nstep time under {args.device_profile} ({profile.name}, measured rates):")
        for label, seconds in times.items():
            print(f"  {label:<20} " + ("n/a: " + seconds if isinstance(seconds, str) else f"{seconds * 1e3:.2f} ms"))
    if args.explain:
        print(report.explain(rows))
    return 0


def _step_seconds(plan, gpu):
    """Predicted seconds per optimizer step, or why there is none (a link the profile lacks)."""
    try:
        return step_time(plan, gpu).total_s
    except ShardfitError as exc:
        return str(exc)
