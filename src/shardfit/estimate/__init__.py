"""Second stage: bytes per rank by category and phase for a Plan (analytic; no torch)."""
