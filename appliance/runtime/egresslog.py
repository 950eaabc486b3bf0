"""What becomes of every proxied flow outside its run: the /metrics counters, and one JSON
line per flow appended to `SANDBOX_EGRESS_LOG` when it is set (an audit trail that outlives
the runs and their clients)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Counter

from appliance.core.egress import Flow
from appliance.core.errors import StartupError
from appliance.runtime.metrics import Metrics

if TYPE_CHECKING:
    from appliance.sandbox.egressproxy import Scope

log = logging.getLogger("appliance.egress")


class EgressAudit:
    def __init__(self, metrics: Metrics, path: Path | None) -> None:
        self.metrics = metrics
        # The labelled counters, looked up once: a lookup per flow is a lock and a dict each.
        self._flows: dict[str, Counter] = {}
        self._up = metrics.egress_bytes.labels(direction="up")
        self._down = metrics.egress_bytes.labels(direction="down")
        self._fd: int | None = None
        if path is not None:
            try:
                # Appended by this process alone, one write per line; not readable by others.
                self._fd = os.open(
                    path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
                )
            except OSError as exc:
                raise StartupError(f"SANDBOX_EGRESS_LOG: cannot open {path}: {exc.strerror}") from None
            st = os.fstat(self._fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
                os.close(self._fd)
                self._fd = None
                raise StartupError(
                    f"SANDBOX_EGRESS_LOG: {path} must be a regular file of the server's own, "
                    "readable by it alone (chmod 600)"
                )

    def __call__(self, flow: Flow, scope: Scope | None) -> None:
        counter = self._flows.get(flow.decision)
        if counter is None:  # a handful of decisions, each bound on its first flow
            counter = self._flows[flow.decision] = self.metrics.egress_flows.labels(decision=flow.decision)
        counter.inc()
        self._up.inc(flow.bytes_up)
        self._down.inc(flow.bytes_down)
        if self._fd is None:
            return
        record = {
            "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
            "request": scope.request_id if scope is not None else None,
            **flow.as_dict(),
        }
        try:
            os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        except OSError as exc:
            log.error("could not append to SANDBOX_EGRESS_LOG", extra={"error": exc.strerror})

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
