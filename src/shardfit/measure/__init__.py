"""Measurement: live tensor bytes by phase and category on every rank (`shardfit.profile`), gathered
over ranks, compared with the estimator, and OOM diagnosis. torch is imported only by the tracker."""
