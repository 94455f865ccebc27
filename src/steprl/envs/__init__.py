"""Environments: the protocol, tool environments, parsing, rewards, the registry and the checker."""
