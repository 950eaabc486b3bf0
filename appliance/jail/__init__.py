"""The jail core shared by every image: spec, firejail argv, run dirs, process, driver, pool."""
