"""`shardfit models`: the shipped presets (or one model reference) as a table or JSON. No torch."""
from __future__ import annotations

import json

from shardfit.spec.models import list_presets, load_model_spec


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="show one model instead of the presets: a preset, a config.json path or directory, "
                             "or a factory pkg.module:fn")
    parser.add_argument("--json", action="store_true", help="print the specs as JSON (every ModelSpec field)")


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
    specs = [load_model_spec(args.model)] if args.model else list_presets()
    if args.json:
        print(json.dumps([s.to_dict() for s in specs], indent=2))
    else:
        print(format_table(specs))
    return 0
