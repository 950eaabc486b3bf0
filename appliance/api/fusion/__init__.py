"""SandboxFusion's HTTP API on the appliance's own port, so RL trainers and eval harnesses
that call SandboxFusion (verl's sandbox_fusion reward among them) run here unchanged
(docs/fusion.md).

- `shapes`: SandboxFusion's request and response bodies; pure.
- `languages`: the languages served and the cell that runs each in a jail.
- `engine`: requests as runs of the run service, events back into results.
- `routes`: the HTTP routes.
"""

from appliance.api.fusion.routes import PATHS, add_routes, token

__all__ = ["PATHS", "add_routes", "token"]
