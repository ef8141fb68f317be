"""Peer-library workloads, each run as a subprocess from its own virtualenv (never the project's)."""
