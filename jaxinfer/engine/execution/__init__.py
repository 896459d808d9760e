"""Execution: the step's types (step.py), the batch builder that turns a schedule into padded
host arrays, the device-side assembly and per-request row tables, and the model runner that
runs the jitted programs."""
