"""Third stage: search the plan space for the fastest plan that fits (analytic; no torch)."""
from shardfit.fit.explain import Rejection
from shardfit.fit.search import Candidate, FitRequest, FitResult, fit
from shardfit.fit.steptime import StepTime, step_time

__all__ = ["Candidate", "FitRequest", "FitResult", "Rejection", "StepTime", "fit", "step_time"]
