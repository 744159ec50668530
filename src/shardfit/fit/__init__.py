"""Third stage: search the plan space for the fastest plan that fits (analytic; no torch).

`fit.search.fit(fit.request.FitRequest)`; the step-time model is fit/steptime.py. NOTE: this file
imports nothing, so `plan`, which needs only the step-time model, does not import the search.
"""
