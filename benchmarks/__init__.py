"""Benchmarks of the appliance. `python -m benchmarks` (or `appliance bench`) runs the main suite
(benchmarks.suite); `benchmarks.soak` and `benchmarks.gpu_contention` are separate entry points."""
