"""The one launcher helper for multi-rank tests: real torchrun processes on 127.0.0.1 (or DeepSpeed's
own launcher), bounded by a timeout so a hang fails fast with a clear message instead of stalling
the suite."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from shardfit import launcher
from shardfit.launcher import free_port  # noqa: F401 - the tests' free port is the launcher's
from shardfit.runtime_env import launch_env

REPO = Path(__file__).resolve().parents[1]


def test_env(**extra: str) -> dict:
    env = launch_env()
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def oom_exit_codes(stderr: str) -> list[int]:
    """The exit codes torchrun's failure summary lists, one per rank that did not end with 0. After an
    OOM, every rank ends with shardfit's code 3, or is stopped (SIGTERM, -15) by torchrun once a peer
    has ended: which one a rank gets is the launcher's timing."""
    return [int(code) for code in re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", stderr, re.MULTILINE)]


def torchrun(args: list[str], nproc: int = 2, timeout: float = 180, nnodes: int = 1, node_rank: int | None = None,
             port: int | None = None, env: dict | None = None, cwd: Path | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node nproc ARGS` (ARGS start with a script path or `-m module`) through
    the product's one launcher: at the timeout the whole job, ranks included, is stopped. One node
    without a port: --standalone; with a port (or several nodes): 127.0.0.1:port."""
    endpoint = f"127.0.0.1:{port or free_port()}" if (port or nnodes > 1) else None
    done = launcher.torchrun(list(args), nproc, timeout=timeout, nnodes=nnodes, node_rank=node_rank or 0,
                             endpoint=endpoint, env=env or test_env(), cwd=cwd or REPO, capture=True)
    command = " ".join(map(str, done.command))
    if done.timed_out:
        raise AssertionError(f"timed out after {timeout:.0f}s (a hang?), every rank stopped: {command}\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    if check and done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}: {command}\n"
                             f"--- stdout ---\n{done.stdout[-4000:]}\n--- stderr ---\n{done.stderr[-6000:]}")
    return subprocess.CompletedProcess(list(done.command), done.returncode, done.stdout, done.stderr)


def measure_worker(configs: list[dict], folder: Path, nproc: int, timeout: float, env: dict | None = None) -> dict:
    """One torchrun launch of shardfit.measure.worker over every configuration (launches cost seconds
    each on CPU): label -> result. A configuration that raised fails here, with the rank's traceback."""
    (folder / "configs.json").write_text(json.dumps(configs))
    out = folder / "out.jsonl"
    torchrun(["-m", "shardfit.measure.worker", str(folder / "configs.json"), str(out)], nproc=nproc, timeout=timeout,
             env=env or test_env())
    found = {}
    for line in out.read_text().splitlines():
        result = json.loads(line)
        assert result["error"] is None, result.get("traceback") or result["error"]
        found[result["label"]] = result
    return found


def run(command: list[str], timeout: float = 180, env: dict | None = None, cwd: Path | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (a CLI that may itself start torchrun) in a process group of its own: at the
    timeout the whole group is killed, not only the command."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env or test_env(), cwd=cwd or REPO, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"timed out after {timeout:.0f}s (a hang?): {' '.join(map(str, command))}\n"
                             f"--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n{stderr[-3000:]}") from None
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}: {' '.join(map(str, command))}\n"
                             f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-6000:]}")
    return result


def deepspeed_launcher(script: Path, timeout: float = 180, env: dict | None = None,
                       check: bool = True) -> subprocess.CompletedProcess:
    """Run an emitted `run_deepspeed.sh` (DeepSpeed's runner -> its launch.py -> the ranks) so that
    the ranks load the CPU ops scripts/test.sh prebuilt instead of rebuilding them (minutes each,
    past any timeout, in the folder every other DeepSpeed test loads from). A build is current only
    for the same interpreter path and the same ninja: torch writes the absolute paths of the Python
    that builds into build.ninja, and runs the `ninja` first on PATH, whose build log differs between
    versions (the venv's ninja 1.13 writes log v7 and discards Debian's 1.11 v5 log; 1.11 reads v7
    but its command hashes never match): a build by the other ninja looks out of date, and every
    object is compiled again (measured: the shm op rebuilt twice, 190-210 s each on 2 cores). So:
    - `deepspeed` is this interpreter's: DeepSpeed starts the ranks with the runner's own
      sys.executable, and the venv's console script names the interpreter it was installed with
      (#!/work/main/.venv/bin/python, also for a worktree's symlinked venv). The shim folder holds
      that one script, re-pointed; nothing else on PATH changes (the venv's bin/ would bring its ninja).
    - TORCH_EXTENSIONS_DIR is test_env's (the runner passes the environment on unchanged on one node).
    At the timeout the whole process group is killed, and a build lock a killed rank left behind is
    removed (it would block every later op load until test.sh's 30-minute rule)."""
    env = dict(env or test_env())
    shim = Path(tempfile.mkdtemp(prefix="shardfit-ds-bin-"))
    console = Path(sys.executable).with_name("deepspeed").read_text().splitlines(keepends=True)
    (shim / "deepspeed").write_text(f"#!{sys.executable}\n" + "".join(console[1:]))
    (shim / "deepspeed").chmod(0o755)
    env["PATH"] = f"{shim}{os.pathsep}{env.get('PATH', '')}"
    ops = Path(env["TORCH_EXTENSIONS_DIR"])
    remove_stale_locks(ops)
    built = _op_builds(ops)
    try:
        result = run(["bash", str(script)], timeout=timeout, env=env, cwd=Path(script).parent, check=check)
    finally:
        remove_stale_locks(ops)
        shutil.rmtree(shim, ignore_errors=True)
    after = _op_builds(ops)
    rebuilt = sorted(f"{path.parent.name}/{path.name}" for path, mtime in built.items() if after.get(path) != mtime)
    assert not rebuilt, (f"the ranks rebuilt prebuilt DeepSpeed ops {rebuilt} in {ops}: their interpreter "
                         "path or ninja differs from the prebuild's")
    return result


def _op_builds(extensions: Path) -> dict[Path, float]:
    """Each built op's objects and library -> modification time."""
    return {path: path.stat().st_mtime for path in Path(extensions).glob("*/*") if path.suffix in (".o", ".so")}


def remove_stale_locks(extensions: Path) -> list[Path]:
    """Delete torch-extension build locks no live process holds. A builder keeps its lock open from
    creation to release (torch.utils.file_baton), so a lock nobody has open was left by a killed
    build. Locks are listed before the processes are scanned: one created after the scan is not in
    the list."""
    locks = {}
    for path in Path(extensions).glob("*/lock"):
        try:
            locks[path] = path.stat().st_ino
        except FileNotFoundError:  # released meanwhile
            continue
    if not locks or not Path("/proc/self/fd").is_dir():
        return []
    held = set()
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                held.add(os.readlink(fd))
        except OSError:  # gone, or not ours to read
            continue
    removed = []
    for path, inode in locks.items():
        try:
            if str(path.resolve()) not in held and path.stat().st_ino == inode:
                path.unlink()
                removed.append(path)
        except FileNotFoundError:  # released meanwhile
            continue
    return removed


def shardfit(*args: str, timeout: float = 120, check: bool = True, env: dict | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess."""
    return run([sys.executable, "-m", "shardfit", *args], timeout=timeout, check=check, env=env, cwd=cwd)


def run_records(out: Path) -> list[dict]:
    """Every line of a run's metrics.jsonl, in order."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def run_losses(out: Path) -> dict:
    """step -> loss from a run's metrics.jsonl; a step replayed after a restart keeps its last value."""
    found = {}
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        found[record["step"]] = record["loss"]
    return found


def load_benchmark(name: str):
    """A script of benchmarks/ as a module (its functions are what the tests check)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
