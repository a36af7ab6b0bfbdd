"""Fault matrix: real faults against a real pool and real vLLM engines.

faults   store backends with injected faults, loadable by engines under test
matrix   the rows (fault -> expected outcome) and ``run_matrix``; engines are
         driven phase by phase (``kvpool.demo.session``), faults go in between
"""
