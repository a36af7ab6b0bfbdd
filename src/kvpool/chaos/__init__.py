"""Fault matrix: real faults against a real pool and real vLLM engines.

faults       store backends with injected faults, loadable by engines under test
harness      what the rows share (context, pools, helpers) and ``run_row``
pool_rows    rows of the pool's faults: its processes, memory and bytes
engine_rows  rows of the engine's faults: lookup socket, config, process
matrix       the row table (fault -> expected outcome) and ``run_matrix``; engines
             are driven phase by phase (``kvpool.demo.session``), faults go in between
"""
