"""The sandbox's side of the run service (appliance.core.ports.Cells): runs a cell in a
leased jail, watches an idle session's jail, reads and keeps a run's outputs/ files.

The service hands back the jails its lease source gave it; anything else is refused
(TypeError), never run as if it were a jail.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Sequence

from appliance.core.domain import CellOutcome, RunRequest
from appliance.core.egress import Flow, Layers, Narrowing
from appliance.core.egressask import EgressAsks
from appliance.core.egresssecrets import Secrets
from appliance.core.events import EgressDenied, Emit, Started
from appliance.core.ports import Jail as AnyJail
from appliance.sandbox import outputs
from appliance.sandbox.cell import disk_violation, run_cell, stdin_ops
from appliance.sandbox.egressproxy import Scope
from appliance.sandbox.jail import Jail
from appliance.settings import Settings

log = logging.getLogger("appliance.sandbox.jailcells")


def _own(jail: AnyJail) -> Jail:
    if not isinstance(jail, Jail):
        raise TypeError(f"not a jail of this sandbox: {type(jail).__name__}")
    return jail


class JailCells:
    """Cells in firejail jails, under the settings' per-run limits."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def stdin_ops(self, data: str, eof: bool) -> list[bytes]:
        return stdin_ops(data, eof)

    async def run(  # noqa: PLR0913 (the cell, its limit and its hooks, keywords after the jail and request)
        self,
        jail: AnyJail,
        req: RunRequest,
        emit: Emit,
        *,
        timeout_ms: int,
        keep_alive: bool,
        started: Callable[[], None],
        first: Started,
        egress: Narrowing = (),
        egress_secrets: Secrets | None = None,
        asks: EgressAsks | None = None,
    ) -> CellOutcome:
        s = self.settings
        own = _own(jail)
        # Names mode: the jail's flows are this run's from here to its end (its ledger), held
        # to the server's allowlist and what narrows it; a refusal is told as it happens.
        proxy = own.network.proxy if own.network is not None else None
        link = own.link if proxy is not None else None
        scope: Scope | None = None
        if proxy is not None and link is not None:

            async def denied(flow: Flow) -> None:
                await emit(EgressDenied(flow.host, flow.port, flow.why or "denied"))

            scope = Scope(
                Layers(s.egress_allow_domains, egress, asks is not None), req.id, denied, egress_secrets, asks
            )
            proxy.begin(link, scope)
        try:
            outcome = await run_cell(
                own,
                req,
                emit,
                timeout_ms=timeout_ms,
                max_output_bytes=s.max_output_bytes,
                max_disk_mb=s.max_disk_mb,
                keep_alive=keep_alive,
                started=started,
                first=first,
            )
        finally:
            if proxy is not None and link is not None:
                proxy.end(link)
            if scope is not None:
                await scope.close()  # no denial is told after the cell's end
        if scope is not None:
            outcome.egress = tuple(scope.ledger())
            outcome.egress_omitted = scope.omitted or None
        return outcome

    async def between_cells(self, jail: AnyJail) -> str | None:
        own = _own(jail)
        verdict = own.process.violation()
        if verdict is not None:
            return f"{verdict.message} (between cells)"
        found = await asyncio.to_thread(disk_violation, own, self.settings.max_disk_mb)
        return f"{found.message} between cells" if found is not None else None

    def has_outputs(self, jail: AnyJail) -> bool:
        return outputs.has_any(_own(jail).workdir)

    async def snapshot(self, jail: AnyJail) -> outputs.Snapshot:
        own = _own(jail)
        return await asyncio.to_thread(outputs.snapshot, own.workdir, own.uid)

    def outputs(self, jail: AnyJail, before: object | None, owner: str, run_id: str) -> RunOutputs:
        if before is not None and not isinstance(before, dict):
            raise TypeError(f"not a snapshot of outputs/: {type(before).__name__}")
        return RunOutputs(self.settings, _own(jail), before, owner, run_id)


class RunOutputs:
    """One run's new or changed outputs/ files, in batches read in a thread, each persisted
    (SANDBOX_OUTPUTS_DIR) once the service has sent it."""

    def __init__(
        self,
        settings: Settings,
        jail: Jail,
        before: outputs.Snapshot | None,
        owner: str,
        run_id: str,
    ) -> None:
        s = settings
        self._tally = outputs.Tally(s.max_outputs_bytes, s.max_output_files)
        self._files = outputs.stream(jail.workdir, jail.uid, before, s.max_file_out_bytes, self._tally)
        self._keep = outputs.Persister(s.outputs_dir, owner, run_id) if s.outputs_dir is not None else None
        self._run_id = run_id

    async def batches(self) -> AsyncGenerator[Sequence[outputs.OutputFile], None]:
        keep = self._keep
        try:
            while batch := await asyncio.to_thread(outputs.next_batch, self._files):
                yield batch  # the service sends it; then it is kept
                if keep is not None:
                    try:
                        await asyncio.to_thread(_persist_all, keep, batch)
                    except OSError as exc:
                        log.error("could not persist outputs", extra={"run": self._run_id, "error": str(exc)})
                        keep.close()
                        keep = None
                del batch
        finally:
            # A cancelled run may leave a batch being read in its thread: the generator then
            # closes (and its descriptors with it) when it is collected.
            with contextlib.suppress(ValueError):
                self._files.close()
            if keep is not None:
                keep.close()

    def note(self) -> str | None:
        return self._tally.note()

    @property
    def skipped(self) -> int:
        return self._tally.skipped


def _persist_all(keep: outputs.Persister, batch: list[outputs.OutputFile]) -> None:
    for item in batch:
        keep.write(item)
