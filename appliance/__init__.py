"""The appliance: a jailed Python exec sandbox served over WebSocket."""

__version__ = "0.1.0"
