"""Prometheus metrics of one appliance, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.runs = Counter("appliance_runs", "Runs by final status", ["status"], registry=r)
        self.run_seconds = Histogram(
            "appliance_run_duration_seconds", "Run wall time", buckets=BUCKETS_S, registry=r
        )
        self.queue_seconds = Histogram(
            "appliance_queue_wait_seconds", "Time queued before a jail", buckets=BUCKETS_S, registry=r
        )
        self.pool_ready = Gauge("appliance_pool_ready", "Ready jails in the pool", registry=r)
        self.pool_starting = Gauge("appliance_pool_starting", "Jails being started for the pool", registry=r)
        self.pool_target = Gauge("appliance_pool_target", "Jails the pool currently aims to keep", registry=r)
        self.jail_pss = Gauge(
            "appliance_jail_pss_bytes", "PSS of a warm jail, measured at most every 10 s", registry=r
        )
        self.cold_starts = Counter("appliance_cold_starts", "Runs that found the pool empty", registry=r)
        self.jails_spawned = Counter("appliance_jails_spawned", "Jails started", registry=r)
        self.sessions = Gauge("appliance_sessions_active", "Open sessions", registry=r)
        self.gpu_sessions = Gauge(
            "appliance_gpu_sessions_active", "Open sessions holding a GPU budget", registry=r
        )
        self.gpu_session_memory = Gauge(
            "appliance_gpu_session_memory_bytes", "GPU memory budgets held by open sessions", registry=r
        )
        self.bytes_streamed = Counter("appliance_bytes_streamed", "Output bytes sent to clients", registry=r)
        self.egress_flows = Counter(
            "appliance_egress_flows",
            "Connections through the egress proxy, by decision (allowed, denied, failed)",
            ["decision"],
            registry=r,
        )
        self.egress_bytes = Counter(
            "appliance_egress_bytes",
            "Bytes through the egress proxy, by direction (up: from jails)",
            ["direction"],
            registry=r,
        )
        self.queue_depth = Gauge("appliance_queue_depth", "Requests waiting for a run slot", registry=r)
        self.active_runs = Gauge("appliance_active_runs", "Runs holding a slot", registry=r)
        self.frame_buffer = Gauge(
            "appliance_frame_buffer_bytes",
            "Bytes reserved by WebSocket messages unfinished or not yet taken (SANDBOX_FRAME_BUFFER_BYTES)",
            registry=r,
        )
        self.frames_refused = Counter(
            "appliance_frames_refused",
            "WebSocket frames refused at their header or left unfinished, by reason",
            ["reason"],
            registry=r,
        )
        # Runs kept for `attach` (appliance/api/runlog.py): what is held, and what went, why.
        self.run_logs = Gauge(
            "appliance_run_logs", "Runs whose frames are kept for attach (running or finished)", registry=r
        )
        self.run_log_bytes = Gauge(
            "appliance_run_log_bytes", "Bytes of frames kept for attach, all tenants", registry=r
        )
        self.run_logs_evicted = Counter(
            "appliance_run_logs_evicted",
            "Finished runs no longer kept for attach, by reason: expired (SANDBOX_REATTACH_S), "
            "runs (SANDBOX_REATTACH_RUNS), bytes (SANDBOX_REATTACH_BYTES)",
            ["reason"],
            registry=r,
        )
        self.run_frames_dropped = Counter(
            "appliance_run_frames_dropped",
            "Frames a run's kept log let go, oldest first, to stay within SANDBOX_MAX_OUTPUT_BYTES",
            registry=r,
        )
        # Per preload profile (appliance.sandbox.profiles): which warm jails runs get.
        self.profile_runs = Counter(
            "appliance_profile_runs", "Runs given a jail of this profile", ["profile"], registry=r
        )
        self.profile_cold_starts = Counter(
            "appliance_profile_cold_starts",
            "Runs of this profile that found its pool empty",
            ["profile"],
            registry=r,
        )
        self.profile_ready = Gauge(
            "appliance_profile_pool_ready", "Ready jails of this profile", ["profile"], registry=r
        )
        self.profile_target = Gauge(
            "appliance_profile_pool_target",
            "Jails of this profile the pool aims to keep",
            ["profile"],
            registry=r,
        )
        self.profile_pss = Gauge(
            "appliance_profile_jail_pss_bytes",
            "PSS of a warm jail of this profile, measured at most every 10 s",
            ["profile"],
            registry=r,
        )
        self.preloaded_imports = Counter(
            "appliance_preloaded_module_imports",
            "Runs whose code imports this preloaded package (static scan)",
            ["module"],
            registry=r,
        )
        self.import_seconds = Histogram(
            "appliance_cell_import_seconds",
            "Time a cell spent loading modules not yet imported in its jail",
            ["profile"],
            buckets=BUCKETS_S,
            registry=r,
        )

        # GPU mode: a finished run's grant is held until NVML shows its memory freed.
        self.gpu_reclaim_seconds = Histogram(
            "appliance_gpu_reclaim_wait_seconds",
            "Time a finished GPU run's grant was held until NVML showed it freed",
            buckets=BUCKETS_S,
            registry=r,
        )
        self.gpu_reclaim_timeouts = Gauge(
            "appliance_gpu_reclaim_timeouts",
            "Finished GPU runs whose memory NVML still listed after SANDBOX_GPU_RECLAIM_MS",
            registry=r,
        )

        # GPU mode, layer (b): whether MPS limits hold per device, and what stands in their way.
        self.gpu_mps_enforcing = Gauge(
            "appliance_gpu_mps_enforcing",
            "1 where daemon-side MPS memory limits are proven on the device",
            ["device"],
            registry=r,
        )
        self.gpu_mps_blocked = Gauge(
            "appliance_gpu_mps_blocked",
            "1 for each reason MPS limits cannot hold a jailed run on the device "
            "(dev_shm, compute_mode, pid_namespace)",
            ["device", "reason"],
            registry=r,
        )
        # GPU mode under SANDBOX_GPU_ENFORCE=best-effort: what the watchdog cannot enforce here.
        self.gpu_degraded = Gauge(
            "appliance_gpu_degraded",
            "1 for each reason GPU budgets are enforced only in part on this host (SANDBOX_GPU_ENFORCE="
            "best-effort): per_process_memory, proc_children, smaps_rollup, nvidia_uvm, device_minor",
            ["reason"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
