"""SSH transport: connections with real host-key checks."""
