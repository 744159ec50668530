"""Second stage: bytes per rank by category and phase for a Plan (analytic; no torch)."""
from shardfit.estimate.estimator import ACCOUNTING, estimate, shard_degree
from shardfit.estimate.result import CATEGORIES, OVERHEADS, PHASES, Estimate, Term

__all__ = ["ACCOUNTING", "CATEGORIES", "OVERHEADS", "PHASES", "Estimate", "Term", "estimate", "shard_degree"]
