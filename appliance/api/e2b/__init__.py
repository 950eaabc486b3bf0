"""E2B's wire, spoken on the appliance's own port, so the unmodified E2B SDK runs here.

Point the SDK at `http://HOST:PORT/e2b` with both `E2B_API_URL` and `E2B_SANDBOX_URL`, and
use a tenant's token as `E2B_API_KEY` (docs/e2b.md). An E2B sandbox is a set of sessions of
the run service, one per code context, bound to the tenant whose key created it: every
quota of the native protocol applies, because every cell goes through the same service.

- `shapes`: the JSON the SDK reads (sandboxes, errors, NDJSON lines); pure.
- `registry`: which sandboxes live, whose they are, when they end; pure.
- `control`: the control API (`/e2b/sandboxes`, `/e2b/v2/sandboxes`).
- `interpreter`: sandbox traffic (`/e2b/execute`, `/e2b/contexts`, `/e2b/health`).
- `commands`: a sandbox's commands (envd's process service runs them in its jail).
- `proxy`: requests for a server inside a sandbox (`get_host`), to its port in the jail.
"""

from appliance.api.e2b.proxy import proxy_middleware
from appliance.api.e2b.routes import add_routes

__all__ = ["add_routes", "proxy_middleware"]
