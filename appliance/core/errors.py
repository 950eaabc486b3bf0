"""The appliance's error tree and its one mapping to `done.status`.

    ApplianceError
    ├── SettingsError        a SANDBOX_* setting is invalid     -> startup stops
    ├── StartupError         the host cannot run jails as set   -> startup stops
    ├── RequestRejected      bad request, nothing ran           -> rejected
    ├── Busy                 queue or quota full, nothing ran   -> busy
    ├── JailFailure          the jail could not be made/checked -> internal
    │   ├── JailStartFailed  firejail exited before the driver was up
    │   ├── JailExited       the driver went away while an event was awaited
    │   └── GpuLimitUnavailable  the run's MPS memory limit could not be set
    └── RunLimit             the run hit a limit we enforce
        ├── RunTimeout       wall clock                         -> timeout
        ├── MemoryLimit      memory cap / MemoryError           -> memory_limit
        ├── OutputLimit      output bytes or disk quota         -> output_limit
        ├── Cancelled        interrupt or client gone           -> cancelled
        └── GpuMemoryLimit   GPU memory over the run's budget   -> gpu_memory_limit

Anything else that escapes is reported as `internal` with no details.
"""

from __future__ import annotations


class ApplianceError(Exception):
    """Base of every error the appliance raises on purpose."""

    status = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SettingsError(ApplianceError):
    """A setting from the environment is invalid; startup stops."""


class StartupError(ApplianceError):
    """The host cannot run jails exactly as configured; startup stops."""


class RequestRejected(ApplianceError):
    """The request is malformed or not allowed; nothing ran."""

    status = "rejected"


class UnknownSession(RequestRejected):
    """No open session of that id for this tenant (another tenant's is reported exactly so)."""


class UnknownSnapshot(RequestRejected):
    """No snapshot of that id for this tenant (another tenant's is reported exactly so)."""


class Busy(ApplianceError):
    """The run queue is full; nothing ran. `retry_after_ms`: when to come back, where the
    refuser knows (appliance.core.backpressure); else the service estimates it."""

    status = "busy"

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class JailFailure(ApplianceError):
    """A jail could not be started, or failed its self-check; nothing ran."""

    status = "internal"


class JailStartFailed(JailFailure):
    """firejail exited before the driver was up (nothing was judged, nothing ran)."""


class JailExited(JailFailure):
    """The jail's driver went away while the server waited for one of its events."""

    def __init__(self, output: str) -> None:
        super().__init__("the jail exited unexpectedly")
        self.output = output  # the end of what the jail wrote: for the log, never for clients


class GpuLimitUnavailable(JailFailure):
    """The run's daemon-side GPU memory limit (CUDA MPS) could not be set; nothing ran."""


class RunLimit(ApplianceError):
    """A limit enforced by the appliance stopped the run."""


class RunTimeout(RunLimit):
    status = "timeout"


class MemoryLimit(RunLimit):
    status = "memory_limit"


class OutputLimit(RunLimit):
    status = "output_limit"


class Cancelled(RunLimit):
    status = "cancelled"


class GpuMemoryLimit(RunLimit):
    status = "gpu_memory_limit"


def status_of(exc: BaseException) -> tuple[str, str]:
    """Map an exception to (`done.status`, client-safe message). The one place this happens."""
    if isinstance(exc, ApplianceError):
        return exc.status, exc.message
    return "internal", "internal error"
