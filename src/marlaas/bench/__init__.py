"""Benchmarks that span the whole system (`marlaas bench paper`).

`workloads` loads the versioned workload files, `paper` runs and reports the headline
table, `trl_baseline` runs TRL's `GRPOTrainer` (the only module that imports trl).
"""
