"""The ``wsync`` command of the wheel (and ``python -m wsync``): runs the ``wsync`` program
that the wheel carries beside libwsync in this package's directory, with the same
arguments, in this process (exec), so its exit status and signals are the program's own.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

PROGRAM = Path(__file__).resolve().parent / "wsync"


def main() -> None:
    """Replaces this process with the package's ``wsync`` program."""
    if not os.access(PROGRAM, os.X_OK):
        sys.stderr.write(
            f"wsync: this installation of the Python package has no wsync program ({PROGRAM} is missing):\n"
            "install the wheel (pip install PATH/TO/wsync, the repository's root), or run the program of a build "
            "(scripts/dev.sh build makes build/wsync)\n")
        sys.exit(1)
    os.execv(PROGRAM, ["wsync", *sys.argv[1:]])


if __name__ == "__main__":
    main()
