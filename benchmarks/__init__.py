"""Benchmarks and GPU scripts of jax-flash, outside the library (it never
imports them). `python -m benchmarks.harness` is the benchmark; the other
modules are scripts run from the repository root
(`PYTHONPATH=. python benchmarks/<script>.py`), each saying what it
measures."""
