"""The ``kvpool`` command line, an optional extra (``pip install kvpool[cli]``).

``import kvpool`` never imports click or rich; ``main`` imports them on first
use and, if they are missing, says in one line what to install.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvpool`` command; returns the exit status."""
    try:
        from kvpool.cli.app import run
    except ImportError as exc:  # click or rich missing
        print(
            f"kvpool: the CLI needs click and rich ({exc}); run: pip install 'kvpool[cli]'",
            file=sys.stderr,
        )
        return 2
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
