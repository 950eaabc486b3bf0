"""The host side of a jail: spec, firejail argv, run dirs, process plumbing, cells, pool, lease,
cgroups, network, outputs."""
