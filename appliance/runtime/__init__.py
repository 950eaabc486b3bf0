"""Assembling the server: startup and shutdown, health, the canary, metrics, logs."""
