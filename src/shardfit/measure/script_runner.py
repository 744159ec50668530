"""Run a user's training script under `shardfit.profile` (discovery mode: the model is found at its
first top-level forward, the optimizer at its first step) and write this rank's report as JSON.

    torchrun --nproc-per-node 2 -m shardfit.measure.script_runner OUTDIR train.py ARGS...

Each rank writes OUTDIR/rank{RANK}.json when the script ends, even if it raised (an OOM included),
so the reports survive a script that destroys its process group; `shardfit profile --script`
gathers the files.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir, script, script_args = Path(argv[0]), argv[1], argv[2:]
    import shardfit

    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    prof = shardfit.profile(explain_oom=True, label=Path(script).name)
    code = 0
    try:
        with prof:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:  # noqa: BLE001 - report what was measured, then fail like the script
        print(f"shardfit profile: the script raised {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 1
    report = prof.report()
    rank = int(os.environ.get("RANK", "0"))
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report.to_dict()))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
