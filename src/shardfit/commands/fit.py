"""`shardfit fit MODEL --gpu H100-80GB --gpus 32 [--nodes 4] --seq 4096 --global-batch 512`: the fastest plan
that fits with margin, the runners-up, and why every other family lost. No torch."""
from __future__ import annotations

import json
import sys

from shardfit.commands.kernel_flags import add_kernel_arguments, kernel_changes
from shardfit.commands.lora_flags import add_lora_arguments, lora_asked, lora_from_args, lora_line
from shardfit.emit.torchtitan import torchtitan_runs
from shardfit.errors import ShardfitError
from shardfit.fit.request import FitRequest
from shardfit.fit.search import fit
from shardfit.fit.report import format_text, to_json
from shardfit.fit.rungs import RUNG_NAMES
from shardfit.measure.verify import verify
from shardfit.spec.device_profile import load_profile
from shardfit.spec.gpus import get_gpu, split_gpus
from shardfit.spec.models import load_model_spec
from shardfit.spec.plan import Plan, Schedule
from shardfit.spec.planfile import dump_plan
from shardfit.commands.setup_flags import add_setup_arguments, plan_from_args
from shardfit.spec.sizes import gib_type
from shardfit.estimate.estimator import estimate
from shardfit.units import fmt_bytes


def add_arguments(parser) -> None:
    parser.add_argument("model", help="preset name (see `shardfit models`), config.json path/folder, or pkg.module:fn")
    parser.add_argument("--gpu", default=None, help="GPU catalog name, or custom:SIZE (custom:24 is GiB; custom:80GB) (default H100-80GB)")
    parser.add_argument("--gpus", type=int, default=8,
                        help="total GPUs (default 8); without --nodes, nodes of 8 above 8 GPUs")
    parser.add_argument("--nodes", type=int, help="nodes (GPUs per node = --gpus / --nodes)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length in tokens (default 2048)")
    parser.add_argument("--global-batch", type=int, dest="global_batch",
                        help="sequences per optimizer step, kept fixed (default 4 per GPU)")
    add_lora_arguments(parser)
    parser.add_argument("--ac", default=None,
                        help="pin activation checkpointing (none, selective, full, every-N); fit searches the rest")
    parser.add_argument("--micro-batch", type=int, default=None, dest="micro_batch",
                        help="pin the micro-batch (a divisor of the sequences per GPU); accumulation makes up the rest")
    parser.add_argument("--strategy", default=None,
                        help="pin the strategy (a label `plan --strategy` takes: fsdp2, zero3+offload, ...)")
    add_setup_arguments(parser)
    parser.add_argument("--margin", type=float, default=0.10, help="fraction of device memory kept free (default 0.10)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32", "bf16-pure"),
                        help="force a precision (default: bf16 where the GPU supports it, else fp16 + loss scaling; "
                             "pure bf16 is tried before offload when nothing else fits)")
    parser.add_argument("--optimizer", default=None,
                        help="adamw, adamw8bit, sgd, lion, adafactor (default adamw; 8-bit AdamW is tried before "
                             "offload when nothing else fits; giving --optimizer pins it)")
    add_kernel_arguments(parser, fit=True)
    parser.add_argument("--engine", default="single,ddp,deepspeed,fsdp",
                        help="comma list of engines to search: single (one GPU only), ddp, deepspeed, fsdp (default all)")
    parser.add_argument("--data-parallel-only", action="store_true",
                        help="search no tensor / pipeline / context parallel layouts (for a trainer that runs data "
                             "parallel only: HF Trainer, DeepSpeed, Lightning, shardfit train)")
    parser.add_argument("--cpu", action="store_true",
                        help="budget for a CPU run: compare tensor bytes only (no CUDA context / NCCL)")
    parser.add_argument("--host-memory-gib", "--host-memory", type=gib_type("--host-memory-gib"), dest="host_memory_gib",
                        help="host RAM per node: a size (512GB, 1TiB) or plain GiB; offload plans that exceed it are rejected")
    parser.add_argument("--nvme-path", dest="nvme_path",
                        help="NVMe mount for ZeRO-Infinity offload (needed to write a plan that offloads to NVMe)")
    parser.add_argument("--top", type=int, default=3, help="alternatives to show (default 3)")
    parser.add_argument("--steps", type=int, help="training steps to write into the plan")
    parser.add_argument("-o", "--output", help="write the best plan to this YAML/JSON file (for emit/train)")
    parser.add_argument("--verify", action="store_true",
                        help="run the chosen plan for a few real steps on the devices here (2 CPU ranks without GPUs) "
                             "and correct the memory prediction from the measurement")
    parser.add_argument("--device-profile", dest="device_profile",
                        help="rank by the rates `shardfit calibrate` measured (a profile file) instead of --gpu's "
                             "datasheet; memory stays --gpu's (or the profiled device's without --gpu)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def request_from_args(args):
    engines = tuple(e.strip().lower() for e in args.engine.split(",") if e.strip())
    unknown = [e for e in engines if e not in ("single", "ddp", "deepspeed", "fsdp")]
    if unknown:
        raise ShardfitError(f"--engine '{unknown[0]}' is not known: use single, ddp, deepspeed, fsdp (comma-separated)")
    if args.top < 0:
        raise ShardfitError(f"--top must be 0 or more, got {args.top}")
    model = load_model_spec(args.model)
    lora = lora_from_args(args, model)
    base = Plan(model=model)
    if args.steps is not None:
        if args.steps < 1:
            raise ShardfitError(f"--steps must be at least 1, got {args.steps}")
        base = base.with_changes(schedule=Schedule(steps=args.steps, warmup_steps=min(5, args.steps)))
    gpu_name = args.gpu or "H100-80GB"
    get_gpu(gpu_name)  # a bad GPU name fails here, in one line
    nodes, per_node = split_gpus(args.gpus, args.nodes)
    profiled = None
    if args.device_profile:
        profile = load_profile(args.device_profile)
        profiled = profile.as_gpu(memory_gib=get_gpu(args.gpu).memory_gib if args.gpu else None)
        if args.gpu is None:
            gpu_name = f"custom:{profiled.memory_gib:g}"
    kernels = kernel_changes(args)
    # A knob given on the command line is pinned: its state rung (fit/rungs.py) is not climbed.
    rungs = tuple(r for r in RUNG_NAMES if not (r == "adamw8bit" and args.optimizer is not None)
                  and not (r == "bf16-pure" and args.precision is not None))
    return FitRequest.build(**kernels, model=model, gpu=gpu_name, rungs=rungs, layouts=not args.data_parallel_only, ac=args.ac, micro_batch=args.micro_batch,
                            strategy=args.strategy, device_profile=profiled, gpus_per_node=per_node, nodes=nodes, seq_len=args.seq,
                            global_batch=args.global_batch, lora=lora, margin=args.margin, precision=args.precision,
                            optimizer=(args.optimizer or "adamw").strip().lower(), engines=engines, device="cpu" if args.cpu else "cuda",
                            host_memory_gib=args.host_memory_gib, nvme_path=args.nvme_path, top=args.top, base=base)


def run(args) -> int:
    request = request_from_args(args)
    request, yours = _from_setup(args, request)
    result = fit(request)
    if request.options.device_profile is not None:
        from dataclasses import replace

        result = replace(result, notes=result.notes + (
            f"step times from the device profile {args.device_profile} ({request.options.device_profile.name}: measured "
            "rates, no datasheet efficiencies)",))
    checked = None
    if args.verify and result.best is not None:
        checked = verify(result)
    ok = result.fits and (checked is None or checked.fits)
    if args.output and ok and "nvme" in result.best.plan.strategy.label and not args.nvme_path:
        raise ShardfitError(f"the best plan offloads to NVMe: give --nvme-path (a local NVMe mount) so "
                            f"{args.output} names a real one")
    if args.output and ok:
        dump_plan(result.best.plan, args.output)
    if args.json:
        data = to_json(result)
        if checked is not None:
            data["verify"] = checked.to_json(result)
        print(json.dumps(data, indent=2))
    else:
        if yours is not None:
            print(_setup_line(yours, request, result))
        print(format_text(result))
        if lora_asked(args):
            print(f"note: {lora_line(result.request.base.training.lora, args)}")
        if checked is not None:
            print(checked.line())
            print("\n".join(checked.time_lines(result)))
        if args.output and ok:
            plan = result.best.plan
            if not plan.parallelism.is_default:  # a tp / pp / cp / ep layout: only these formats carry it
                par = plan.parallelism
                formats = "|".join(name for name, ok in (("fsdp2", par.pp == par.cp == par.ep == 1),
                                                         ("accelerate", par.pp == par.ep == 1),
                                                         ("torchtitan", torchtitan_runs(plan)), ("torchrun", True)) if ok)
                entry = "" if "fsdp2" in formats else " --entry your_script.py"
                print(f"wrote {args.output}: next `shardfit emit {args.output} --format {formats}{entry}` "
                      "(a data-parallel trainer: fit --data-parallel-only)", file=sys.stderr)
            else:
                formats = NEXT_FORMATS.get("deepspeed" if plan.strategy.is_deepspeed else plan.strategy.kind,
                                           "accelerate|torchrun") + ("|torchtitan" if torchtitan_runs(plan) else "")
                print(f"wrote {args.output}: next `shardfit emit {args.output} --format {formats}` "
                      f"or `shardfit train {args.output}`", file=sys.stderr)
    return 0 if ok else 1


# What `emit` writes for each engine family (the others refuse the plan in one line), for fit's last line.
NEXT_FORMATS = {"single": "single|hf-trainer|accelerate", "ddp": "ddp|accelerate|torchrun",
                "fsdp": "fsdp|accelerate|lightning", "fsdp2": "fsdp2|accelerate|torchrun",
                "deepspeed": "deepspeed|accelerate|hf-trainer"}


def _from_setup(args, request):
    """With --from-trainer-args / --from-accelerate-config / --deepspeed: the setup's world size, sequence,
    global batch, precision and optimizer become the request's (a flag left at its default does not
    override them); returns (request, the setup's plan or None)."""
    given_gpus = args.gpus if args.gpus != 8 or args.nodes else None
    given_seq = args.seq if args.seq != 2048 else None
    found = plan_from_args(args, request.base.model, world_size=given_gpus, nodes=args.nodes, gpu=request.base.cluster.gpu, seq_len=given_seq)
    if found is None:
        return request, None
    plan = found.plan
    nodes, per_node = split_gpus(plan.cluster.world_size, plan.cluster.nodes)
    changes = {"nodes": nodes, "gpus_per_node": per_node, "seq_len": plan.training.seq_len,
               "global_batch": args.global_batch or plan.global_batch}
    if args.precision is None:
        changes["precision"] = plan.training.precision
    if args.optimizer == "adamw":
        changes["optimizer"] = plan.training.optimizer
    return request.with_changes(**changes), plan


def _setup_line(plan, request, result) -> str:
    """How the setup as given does, next to what fit found."""

    est = estimate(plan, device=request.options.device)
    peak = est.device_peak_bytes if request.options.device == "cuda" else est.peak_bytes
    t = plan.training
    verdict = "fits" if peak <= result.usable_bytes else "does NOT fit"
    return (f"your setup: {plan.strategy.label}, micro-batch {t.micro_batch} x accumulation {t.grad_accum}, "
            f"AC {t.activation_checkpointing}, {t.precision}: {fmt_bytes(peak)} per GPU of "
            f"{fmt_bytes(result.usable_bytes)} usable: {verdict} (global batch {plan.global_batch} kept below)\n")
