"""The estimator's answer: per-rank device bytes by phase and category, runtime overhead, host RAM."""
from __future__ import annotations

from dataclasses import dataclass, field

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
PHASES = ("load", "forward", "backward", "optimizer", "checkpoint")
OVERHEADS = ("cuda_context", "nccl", "allocator_margin")


@dataclass(frozen=True, kw_only=True)
class Term:
    """One named quantity with the formula that produced it, for `--explain` and tests."""
    name: str
    bytes: int
    formula: str
    inputs: dict = field(default_factory=dict)
    source: str = ""


@dataclass(frozen=True, kw_only=True)
class Estimate:
    strategy: str
    # phase -> category -> bytes: the live bytes at that phase's peak, per rank, on the device.
    phases: dict[str, dict[str, int]]
    # CUDA-only runtime costs, reported apart because CPU runs don't have them.
    overhead: dict[str, int]
    # Host RAM per rank (offloaded states, pinned buffers, checkpoint consolidation) and NVMe per rank.
    host: dict[str, int]
    nvme_bytes: int
    terms: tuple[Term, ...] = ()
    assumptions: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def phase_total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_total)

    @property
    def peak_bytes(self) -> int:
        """Tensor bytes at the peak, without runtime overhead (what a CPU run can measure)."""
        return self.phase_total(self.peak_phase)

    @property
    def peak_category(self) -> str:
        at_peak = self.phases[self.peak_phase]
        return max(CATEGORIES, key=lambda category: at_peak[category])

    @property
    def overhead_bytes(self) -> int:
        return sum(self.overhead.values())

    @property
    def device_peak_bytes(self) -> int:
        """What the GPU must hold: tensor peak plus CUDA context, NCCL and allocator margin."""
        return self.peak_bytes + self.overhead_bytes

    def category_peak(self, category: str) -> int:
        return max(self.phases[phase][category] for phase in PHASES)

    def fits(self, device_bytes: int, margin: float = 0.0) -> bool:
        return self.device_peak_bytes <= device_bytes * (1.0 - margin)

    def term(self, name: str) -> Term:
        for term in self.terms:
            if term.name == name:
                return term
        raise KeyError(name)
