"""The suite leaves no process behind: tests/leftover_processes.py.

`make test` spreads the tests over two pytest workers, each test file on one worker
(pytest-xdist's `--dist loadfile`, Makefile), and runs the SLURM tests afterwards in
a pytest of their own, without workers (one local cluster).
"""

from __future__ import annotations

pytest_plugins = ["leftover_processes"]
