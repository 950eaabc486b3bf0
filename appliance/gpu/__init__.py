"""GPU mode: device backends (NVML or simulated), the memory ledger, the watchdog, devices, shaping.

Nothing here imports NVML at import time; only `appliance.gpu.nvml` does, lazily, and
only when SANDBOX_GPU=1 selects it.
"""
