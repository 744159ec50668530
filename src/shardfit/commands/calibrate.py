"""`shardfit calibrate [-o device-profile.json]`: measure this machine's matmul, memory, collective,
overlap, host-copy and optimizer rates; plan / fit / bench then use them with --device-profile."""
from __future__ import annotations

from shardfit.bench.calibrate import calibrate, summary
from shardfit.commands.bench import _default_nproc
from shardfit.errors import ShardfitError


def add_arguments(parser) -> None:
    parser.add_argument("-o", "--output", default="device-profile.json",
                        help="profile file to write, .json or .yaml (default device-profile.json)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks measured at once (default: 2 on CPU, every GPU on CUDA)")
    parser.add_argument("--timeout", type=float, default=240, help="seconds for the measuring job (default 240)")


def run(args) -> int:
    from pathlib import Path

    if args.nproc is not None and args.nproc < 2:
        raise ShardfitError(f"--nproc must be at least 2 (collectives need two ranks), got {args.nproc}")
    if not args.timeout > 0:
        raise ShardfitError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    nproc = args.nproc or max(2, _default_nproc())
    out = Path(args.output)
    print(f"shardfit calibrate: {nproc} ranks -> {out}", flush=True)
    profile = calibrate(out, nproc=nproc, timeout=args.timeout)
    print()
    print("\n".join(summary(profile)))
    print(f"\nwrote {out}: use it with `shardfit fit ... --device-profile {out}` (also plan, bench)")
    return 0
