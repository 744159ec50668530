"""`shardfit models`: the shipped presets (or one model reference) as a table or JSON; a tiny config
of any transformers model type (`--tiny`); the derived-spec cache (`--clear-cache`). No torch for
presets and cached specs."""
from __future__ import annotations

import json
from pathlib import Path

from shardfit.emit.common import write_files
from shardfit.errors import ShardfitError
from shardfit.spec import spec_cache
from shardfit.spec.models import list_presets, load_model_spec
from shardfit.spec.tiny import tiny_config


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="show one model instead of the presets: a preset, a config.json path or directory, "
                             "or a factory pkg.module:fn")
    parser.add_argument("--json", action="store_true", help="print the specs as JSON (every ModelSpec field)")
    parser.add_argument("--tiny", metavar="MODEL_TYPE",
                        help="write a tiny config.json of any transformers model type (qwen3, deepseek_v3, ...) "
                             "to -o DIR: its own defaults with every size shrunk, to train on a CPU")
    parser.add_argument("-o", "--output", metavar="DIR", help="with --tiny: the model directory to write")
    parser.add_argument("--clear-cache", action="store_true",
                        help=f"delete the derived-spec cache ({spec_cache.cache_dir()}); entries are derived again on use")


def format_params(n: int) -> str:
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    if n >= 10**6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}K"


def format_table(specs) -> str:
    header = ("name", "family", "params", "layers", "hidden", "heads/kv", "vocab", "block class")
    rows = [header]
    for s in specs:
        experts = f" ({s.num_experts}x{s.experts_per_token} experts)" if s.num_experts else ""
        rows.append((s.name, s.family, format_params(s.n_params), str(s.num_layers), str(s.hidden_size),
                     f"{s.num_heads}/{s.num_kv_heads}", str(s.vocab_size), s.block_class + experts))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    right = {2, 3, 4, 5, 6}  # numbers align right
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def run(args) -> int:
    if args.clear_cache:
        print(f"removed {spec_cache.clear()} cached spec(s) from {spec_cache.cache_dir()}")
        return 0
    if args.tiny:
        if not args.output:
            raise ShardfitError("--tiny needs -o DIR: the model directory to write config.json into")
        target = Path(args.output) / "config.json"
        if target.exists():
            raise ShardfitError(f"{target} exists: choose another -o directory (nothing was written)")
        write_files({"config.json": json.dumps(tiny_config(args.tiny), indent=2) + "\n"}, target, single=True)
        spec = load_model_spec(str(target.parent))
        print(f"wrote {target}: {spec.model_class}, {format_params(spec.n_params)} params, {spec.num_layers} layers; "
              f"next: shardfit train --model {target.parent} --strategy fsdp2 --nproc 2")
        return 0
    specs = [load_model_spec(args.model)] if args.model else list_presets()
    if args.json:
        print(json.dumps([s.to_dict() for s in specs], indent=2))
    else:
        print(format_table(specs))
    return 0
