"""Third stage: search the plan space for the fastest plan that fits (analytic; no torch)."""
from shardfit.fit.explain import Rejection
from shardfit.fit.request import FitRequest, Pins, SearchOptions
from shardfit.fit.search import Candidate, FitResult, fit
from shardfit.fit.parallel_time import step_time
from shardfit.fit.steptime import StepTime

__all__ = ["Candidate", "FitRequest", "FitResult", "Pins", "Rejection", "SearchOptions", "StepTime", "fit", "step_time"]
