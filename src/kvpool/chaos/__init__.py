"""Fault matrix: real faults against a real pool and real vLLM engines.

faults   store backends with injected faults, loadable by engines under test
session  a vLLM engine process driven phase by phase (faults go in between)
matrix   the rows (fault -> expected outcome) and ``run_matrix``
"""
