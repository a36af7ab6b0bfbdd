"""``kvpool demo`` and its parts: a tiny random model and an engine runner."""
