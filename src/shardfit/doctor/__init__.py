"""Doctor: read existing training configs (and scripts) and list the classic mistakes, with the fix.

The checks run from doctor/diagnose.py (`diagnose`); the readers are doctor/setup.py. NOTE: this
file imports nothing, so `plan --deepspeed ds.json` reading a config through doctor.setup does not
import every rule (and the estimator and fit behind them) on each `plan`.
"""
