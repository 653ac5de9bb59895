"""The local launcher and a trainer that stops for requeue (RELIABILITY.md case 22).

SIGUSR1 to `moerl train` reaches the trainer's ranks (torchrun's children), which
checkpoint and exit with the requeue code; torchrun reports that as 1, so the
launcher reads the rank's marker in the rendezvous directory and returns 85.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moerl.launchers.local import LocalLauncher
from moerl.launchers.stages import RunPlan, StageSpec
from moerl.rendezvous import REQUEUE_EXIT_CODE

PY = sys.executable

RANK_STOPPING_ON_USR1 = """
import signal, sys, time
from moerl.rendezvous import request_requeue
got = []
signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
open(sys.argv[1], "w").write("ready")
while not got:
    time.sleep(0.05)
print("rank: checkpointed, asking for a requeue", flush=True)
sys.exit(request_requeue())
"""


def test_sigusr1_reaches_the_ranks_and_the_launcher_returns_the_requeue_code(
        tmp_path: Path) -> None:
    rank = tmp_path / "rank.py"
    rank.write_text(RANK_STOPPING_ON_USR1)
    ready = tmp_path / "ready"
    plan = RunPlan((StageSpec("trainer", (PY, str(rank), str(ready))),),
                   rendezvous_dir=tmp_path / "rdv", log_dir=tmp_path / "logs")
    signaller = subprocess.Popen(
        [PY, "-c", f"import os, signal, time, pathlib\n"
                   f"p = pathlib.Path({str(ready)!r})\n"
                   f"while not p.exists(): time.sleep(0.1)\n"
                   f"os.kill({os.getpid()}, signal.SIGUSR1)"],
    )  # fmt: skip
    try:
        code = LocalLauncher(plan, grace=2.0, startup_timeout=60).run()
    finally:
        signaller.wait(timeout=120)
    log = (tmp_path / "logs" / "trainer.0.log").read_text()
    assert "rank: checkpointed" in log, log
    assert code == REQUEUE_EXIT_CODE, log
    assert (tmp_path / "rdv" / "requeue").is_file()
