"""What a measurement says: per rank, and gathered over ranks (max / min / imbalance per category).

The measured value of a phase is the breakdown at that phase's peak in the last complete step
(steady state: optimizer states exist, caches are warm). `load` is the memory at rest before that
step (what a run resumed from a checkpoint holds: parameters, optimizer states, persistent buffers);
with a single step it is the end of loading. Construction transients are `load_peak`, apart, and
the end of loading itself (lazy optimizer states not yet created) is `load_end`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from shardfit.estimate.result import CATEGORIES, PHASES
from shardfit.units import fmt_bytes

@dataclass(frozen=True, kw_only=True)
class RankReport:
    rank: int
    world_size: int
    device: str
    label: str = ""
    # phase -> category -> bytes (categories plus "host")
    phases: dict = field(default_factory=dict)
    load_peak: dict = field(default_factory=dict)
    load_end: dict = field(default_factory=dict)
    # every step's peak total per phase, to see growth across steps
    steps: tuple = ()
    cuda: dict = field(default_factory=dict)
    oom: dict | None = None
    budget_bytes: int | None = None

    @classmethod
    def from_profiler(cls, prof) -> "RankReport":
        import os

        phases, cuda = {}, {}
        if prof.load is not None:
            phases["load"] = dict(prof.load.end)
            cuda["load"] = prof.load.cuda
        complete = [s for s in prof.steps if "forward" in s and "optimizer" in s] or [s for s in prof.steps if s]
        if complete:
            last = complete[-1]
            for name, stats in last.items():
                phases[name] = dict(stats.peak)
                cuda[name] = stats.cuda
            index = next(i for i, s in enumerate(prof.steps) if s is last)
            before = prof.steps[index - 1] if index > 0 else {}
            if "optimizer" in before:
                phases["load"] = dict(before["optimizer"].end)
        if prof.checkpoints:
            phases["checkpoint"] = dict(prof.checkpoints[-1].peak)
            cuda["checkpoint"] = prof.checkpoints[-1].cuda
        steps = tuple({name: stats.peak_total for name, stats in step.items()} for step in prof.steps)
        return cls(rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ.get("WORLD_SIZE", "1")),
                   device=prof._device_type, label=prof.label, phases=phases,
                   load_peak=dict(prof.load.peak) if prof.load else {},
                   load_end=dict(prof.load.end) if prof.load else {}, steps=steps,
                   cuda={k: v for k, v in cuda.items() if v}, oom=prof.oom, budget_bytes=prof.budget_bytes)

    def phase_total(self, phase: str) -> int:
        return sum(self.phases.get(phase, {}).get(c, 0) for c in CATEGORIES)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def peak_bytes(self) -> int:
        return self.phase_total(self.peak_phase) if self.phases else 0

    def category_peak(self, category: str) -> int:
        return max((self.phases[p].get(category, 0) for p in self.phases), default=0)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "device": self.device, "label": self.label,
                "phases": self.phases, "load_peak": self.load_peak, "load_end": self.load_end, "steps": list(self.steps), "cuda": self.cuda,
                "oom": self.oom, "budget_bytes": self.budget_bytes, "peak_phase": self.peak_phase if self.phases else None,
                "peak_bytes": self.peak_bytes}

    @classmethod
    def from_dict(cls, data: dict) -> "RankReport":
        return cls(rank=data["rank"], world_size=data["world_size"], device=data["device"], label=data.get("label", ""),
                   phases=data["phases"], load_peak=data.get("load_peak", {}), load_end=data.get("load_end", {}), steps=tuple(data.get("steps", ())),
                   cuda=data.get("cuda", {}), oom=data.get("oom"), budget_bytes=data.get("budget_bytes"))

    def table(self) -> str:
        return format_phase_table(self.phases, title=f"rank {self.rank} ({self.device})")


@dataclass(frozen=True, kw_only=True)
class GatheredReport:
    """All ranks' reports; `phases` is, per phase, the breakdown of the rank with the largest total
    there (what must fit). Not a per-category maximum: each rank's breakdown is one real instant, and
    mixing categories from two ranks' instants adds up to a moment no rank lived (the ranks' peaks
    move by a few tensors from run to run). `spread()` gives the per-category max / min."""
    ranks: tuple

    @property
    def phases(self) -> dict:
        out = {}
        for phase in PHASES:
            have = [r for r in self.ranks if phase in r.phases]
            if have:
                worst = max(have, key=lambda r: (sum(r.phases[phase].get(c, 0) for c in CATEGORIES), -r.rank))
                out[phase] = {cat: worst.phases[phase].get(cat, 0) for cat in CATEGORIES + ("host",)}
        return out

    def spread(self) -> dict:
        """phase -> category -> {max, min, imbalance}: imbalance = (max − min) / max."""
        out = {}
        for phase in self.phases:
            out[phase] = {}
            for cat in CATEGORIES:
                values = [r.phases.get(phase, {}).get(cat, 0) for r in self.ranks]
                high, low = max(values), min(values)
                out[phase][cat] = {"max": high, "min": low, "imbalance": (high - low) / high if high else 0.0}
        return out

    def peak_by_rank(self) -> list:
        return [r.peak_bytes for r in self.ranks]

    @property
    def ooms(self) -> list:
        return [dict(r.oom, rank=r.rank) for r in self.ranks if r.oom]

    def to_dict(self) -> dict:
        return {"world_size": len(self.ranks), "phases": self.phases, "spread": self.spread(),
                "peak_by_rank": self.peak_by_rank(), "ooms": self.ooms, "ranks": [r.to_dict() for r in self.ranks]}

    def imbalance_lines(self, threshold: float = 0.05) -> list[str]:
        lines = []
        for phase, cats in self.spread().items():
            for cat, s in cats.items():
                if s["imbalance"] > threshold and s["max"] > 2**20:
                    lines.append(f"{phase}/{cat}: ranks differ by {s['imbalance']:.0%} "
                                 f"({fmt_bytes(s['min'])} .. {fmt_bytes(s['max'])}): uneven data or sharding")
        return lines


def gather(report: RankReport, everywhere: bool = False) -> GatheredReport | None:
    """Every rank passes its report; rank 0 gets all of them (all_gather_object), others get None
    (or all of them too with everywhere=True). Without a process group the single report is returned."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return GatheredReport(ranks=(report,))
    items = [None] * dist.get_world_size()
    dist.all_gather_object(items, report.to_dict())
    if dist.get_rank() != 0 and not everywhere:
        return None
    return GatheredReport(ranks=tuple(RankReport.from_dict(item) for item in items))


def format_phase_table(phases: dict, title: str = "") -> str:
    header = f"{'phase':<12}" + "".join(f"{c:>13}" for c in CATEGORIES) + f"{'total':>13}"
    lines = [title, header] if title else [header]
    for phase in PHASES:
        if phase not in phases:
            continue
        row = phases[phase]
        total = sum(row.get(c, 0) for c in CATEGORIES)
        lines.append(f"{phase:<12}" + "".join(f"{fmt_bytes(row.get(c, 0)):>13}" for c in CATEGORIES)
                     + f"{fmt_bytes(total):>13}")
    return "\n".join(lines)
