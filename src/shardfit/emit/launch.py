"""Launch commands: torchrun (single- and multi-node), the DeepSpeed launcher with a hostfile, SLURM.
A single-device plan is launched as one plain `python` process: no torchrun, no rendezvous."""
from __future__ import annotations

from shardfit.emit.common import Emitted, EmitOptions, launch_entry
from shardfit.errors import ShardfitError
from shardfit.spec.plan import Plan


def python_command(options: EmitOptions) -> str:
    # NOTE: `python -m shardfit train PLAN` starts its own one-rank torchrun for a single plan; a user
    # script runs as it is, with no process group (so HF Trainer / Accelerate wrap nothing).
    return f"python {launch_entry(options)}"


def _hosts(plan: Plan, options: EmitOptions) -> list[str]:
    nodes = plan.cluster.nodes
    if options.hosts:
        if len(options.hosts) != nodes:
            raise ShardfitError(f"--hosts names {len(options.hosts)} host(s) but the plan has {nodes} node(s)")
        return list(options.hosts)
    return ["localhost"] if nodes == 1 else [f"node-{i}" for i in range(nodes)]


# A multi-node launch script's guard: the same script runs on every node, pointed at the first.
MULTI_NODE_LINES = ("# multi-node: run this same script on every node; MASTER_ADDR = the first node's address",
                    ': "${MASTER_ADDR:?set MASTER_ADDR to the hostname or IP of the first node}"')


def torchrun_command(plan: Plan, options: EmitOptions) -> str:
    c = plan.cluster
    if c.nodes == 1:
        return f"torchrun --standalone --nproc-per-node {c.gpus_per_node} {launch_entry(options)}"
    # c10d rendezvous: the same command on every node, no node rank to get wrong.
    return (f"torchrun --nnodes {c.nodes} --nproc-per-node {c.gpus_per_node} --rdzv-backend c10d "
            f"--rdzv-endpoint {options.master_addr}:{options.master_port} --rdzv-id shardfit-$USER "
            f"{launch_entry(options)}")


def emit_torchrun(plan: Plan, options: EmitOptions) -> Emitted:
    c = plan.cluster
    lines = ["#!/usr/bin/env bash", f"# {plan.model.name}: {plan.strategy.label}, {c.nodes} node(s) x {c.gpus_per_node} GPU(s)",
             "set -euo pipefail"]
    if plan.strategy.kind == "single":
        lines += ["# one device, one process: no torchrun", python_command(options)]
    elif c.nodes == 1:
        lines += ["# single node", torchrun_command(plan, options)]
    else:
        lines += [*MULTI_NODE_LINES, torchrun_command(plan, options)]
    return Emitted(files={"run_torchrun.sh": "\n".join(lines) + "\n"})


def emit_deepspeed_launcher(plan: Plan, options: EmitOptions) -> Emitted:
    c = plan.cluster
    if plan.strategy.kind == "single":
        raise ShardfitError("a single-device plan needs no launcher: use --format torchrun (one plain python "
                            "process) or --format single (a runnable script)")
    hosts = _hosts(plan, options)
    hostfile = "".join(f"{host} slots={c.gpus_per_node}\n" for host in hosts)
    entry = launch_entry(options)
    # --no_local_rank: the entry point reads LOCAL_RANK from the environment like under torchrun.
    module = entry.startswith("-m ")
    target = f"--module {entry[3:]}" if module else entry
    # One node: DeepSpeed's runner still ssh-checks a hostfile's first host before launching locally
    # ("host=localhost was not reachable via ssh"); nothing needs ssh there, so the check is skipped.
    local = " --no_ssh_check" if c.nodes == 1 else ""
    command = (f"deepspeed --hostfile hostfile{local} --num_nodes {c.nodes} --num_gpus {c.gpus_per_node} "
               f"--master_addr {hosts[0]} --master_port {options.master_port} --no_local_rank {target}")
    script = ["#!/usr/bin/env bash", f"# {plan.model.name}: {plan.strategy.label}; run on the first host "
              "(the launcher reaches the others over passwordless ssh/pdsh)", "set -euo pipefail",
              'cd "$(dirname "$0")"', command]
    notes = [] if options.hosts or c.nodes == 1 else ["replace node-0 ... in hostfile with your host names (or pass --hosts)"]
    return Emitted(files={"run_deepspeed.sh": "\n".join(script) + "\n", "hostfile": hostfile}, notes=tuple(notes))


# SLURM warns the batch shell this long before the time limit (or a preemption with GraceTime); the
# trap hands the signal to the ranks, which finish the step, save and exit 75, then the job requeues.
PREEMPT_WARNING_S = 180
STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"  # torchrun passes these on to the ranks


def preemption_lines() -> tuple[list[str], list[str]]:
    """(#SBATCH lines, the shell lines that run `srun ...` in the background with a USR1 trap)."""
    head = [f"#SBATCH --signal=B:USR1@{PREEMPT_WARNING_S}  # warn the batch shell before the time limit",
            "#SBATCH --requeue  # a requeued job resumes from its stop checkpoint (--resume auto)"]
    trap = ['stopping=0', 'job=""',
            "# srun passes USR1 on to the training processes: each rank finishes its step, saves, exits 75",
            "trap 'stopping=1; kill -USR1 \"$job\" 2>/dev/null' USR1"]
    tail = ['job=$!',
            'set +e',
            'wait "$job"; code=$?',
            'while kill -0 "$job" 2>/dev/null; do wait "$job"; code=$?; done  # a trapped signal ends `wait` early',
            'set -e',
            'if [ "$stopping" = 1 ] || [ "$code" = 75 ]; then scontrol requeue "$SLURM_JOB_ID"; exit 0; fi',
            'exit "$code"']
    return head, trap + ["__RUN__ &"] + tail


def _resumable(options: EmitOptions) -> str:
    # A requeued job continues where it stopped: `--resume auto` is a fresh start when there is nothing.
    return launch_entry(options) + ("" if options.entry else " --resume auto")


def emit_slurm(plan: Plan, options: EmitOptions) -> Emitted:
    c = plan.cluster
    cpus = max(4 * c.gpus_per_node, 8)
    head, body = preemption_lines()
    if plan.strategy.kind == "single":
        # One GPU, one process: no rendezvous, and no --exclusive (the rest of the node stays shared).
        lines = ["#!/bin/bash", f"#SBATCH --job-name=shardfit-{plan.model.name}", "#SBATCH --nodes=1",
                 "#SBATCH --ntasks=1", "#SBATCH --gpus=1", f"#SBATCH --cpus-per-task={cpus}",
                 f"#SBATCH --time={options.time_limit}", "#SBATCH --output=%x-%j.out", *head, "set -euo pipefail",
                 f"# single (one device), micro-batch {plan.training.micro_batch} x accumulation "
                 f"{plan.training.grad_accum} = global batch {plan.global_batch}",
                 f"export OMP_NUM_THREADS={cpus}", *_run(body, f"srun python {_resumable(options)}")]
        return Emitted(files={"train.sbatch": "\n".join(lines) + "\n"})
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=shardfit-{plan.model.name}",
        f"#SBATCH --nodes={c.nodes}",
        "#SBATCH --ntasks-per-node=1  # one torchrun per node; it starts the per-GPU ranks",
        f"#SBATCH --gpus-per-node={c.gpus_per_node}",
        f"#SBATCH --cpus-per-task={cpus}",
        f"#SBATCH --time={options.time_limit}",
        "#SBATCH --exclusive",
        "#SBATCH --output=%x-%j.out",
        *head,
        "set -euo pipefail",
        f"# {plan.strategy.label}, micro-batch {plan.training.micro_batch} x accumulation {plan.training.grad_accum} "
        f"x {c.world_size} GPUs = global batch {plan.global_batch}",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={options.master_port}",
        f"export OMP_NUM_THREADS={max(cpus // c.gpus_per_node, 1)}",
        *_run(body, f'srun --kill-on-bad-exit=1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {c.gpus_per_node} '
                    f'--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$SLURM_JOB_ID" '
                    f"--signals-to-handle {STOP_SIGNALS} {_resumable(options)}"),
    ]
    return Emitted(files={"train.sbatch": "\n".join(lines) + "\n"})


def _run(body: list[str], command: str) -> list[str]:
    return [command + " &" if line == "__RUN__ &" else line for line in body]
