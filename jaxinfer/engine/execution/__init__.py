"""Scheduling: which requests run each step and with how many tokens (the scheduler), their
KV-cache blocks (the KV-cache manager over the block pool, with prefix caching), and the
requests host-side state.' > scheduling/__init__.py && echo 'Execution: the steps types (step.py), the batch builder that turns a schedule into padded
host arrays, the device-side assembly and per-request row tables, and the model runner that
runs the jitted programs."""
