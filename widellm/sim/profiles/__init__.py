"""Measured hardware profiles (``cpu.json``: this machine, written by
``benchmarks/sim_cpu_profile.py``) and the code that measures them (``measure_cpu.py``)."""
