"""Pinned-version rollout engine: versioned parameter snapshots and batch collection."""
