"""A run: the coordinator, the launchers (local processes, hosts, ssh), data, checkpoints, the run directory."""
