"""The running cluster: the controller (state store and commands), peers, keys, local
agents, model files."""
