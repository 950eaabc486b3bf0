"""The core: the run service, admission, tenants, sessions, the error hierarchy. No transport
library is imported here."""
