"""Provisioning nodes over SSH: the pure plan, the remote commands, the run."""
