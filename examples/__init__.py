"""Examples of using the appliance (importable so the tests can drive them)."""
