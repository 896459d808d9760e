"""Scheduling: which requests run each step and with how many tokens (the scheduler), their
KV-cache blocks (the KV-cache manager over the block pool, with prefix caching), the requests'
host-side state, when they stop, and the counts."""
