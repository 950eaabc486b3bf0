"""The security audit of a source checkout (`make audit`); not part of the installed package."""
