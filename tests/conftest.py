"""The suite leaves no process behind (tests/leftover_processes.py).

`make test` spreads the tests over pytest workers, each test file on one worker
(pytest-xdist's `--dist loadfile`, Makefile), in xdist's order: the files with the most
tests first, so the many short unit tests run while the SLURM tests, beside the suite
in a pytest of their own without workers (one local cluster), start their jobs, and
the servers, ranks and training runs of the integration files come after.
"""

from __future__ import annotations

pytest_plugins = ["leftover_processes"]
