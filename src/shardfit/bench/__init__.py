"""`shardfit bench`: the same training step under each strategy, side by side.

run.py (orchestrator: one torchrun job per strategy) -> worker.py (inside torchrun: train, measure,
checkpoint) -> analysis.py (judge: reference loss, prediction, theory) -> report.py (table, JSON,
CSV, charts, HTML). comm.py counts collectives; probe.py reads the state a checkpoint must restore.
"""
