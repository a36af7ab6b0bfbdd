"""The one rich console every ``kvpool`` command prints on (tests capture stdout)."""

from __future__ import annotations

from rich.console import Console

console = Console()
