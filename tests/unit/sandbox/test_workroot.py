"""Where work dirs go when the temp dir is private (RELIABILITY.md case 28): a place the
sandbox user can reach, or a refusal at start-up that names the directory and the fix.
As root only: otherwise bwrap runs as the caller, who made the directories itself."""

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from moerl.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from moerl.sandbox.preflight import check_sandbox, open_checked
from moerl.sandbox.workroot import DIR_NAME, WorkRootUnusable, blocking_dir, place_work_root

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox user differs only as root")
NOBODY = 65534


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    """(private, shared) under /tmp (pytest's tmp_path is below a 0700 dir already): a
    0700 dir, as a SLURM job's TMPDIR, and a 0711 one every user can pass through."""
    private = Path(tempfile.mkdtemp(prefix="moerl-test-private-", dir="/tmp"))
    shared = Path(tempfile.mkdtemp(prefix="moerl-test-shared-", dir="/tmp"))
    os.chmod(private, 0o700)
    os.chmod(shared, 0o711)
    yield private, shared
    shutil.rmtree(private)
    shutil.rmtree(shared)


def test_a_private_temp_dir_is_passed_over_for_one_the_sandbox_user_reaches(
    dirs: tuple[Path, Path],
) -> None:
    private, shared = dirs
    assert blocking_dir(private / DIR_NAME, NOBODY, NOBODY) == (private, 0o700, 0)
    root = place_work_root(None, NOBODY, NOBODY, candidates=[private, shared])
    assert root == shared / DIR_NAME
    assert stat.S_IMODE(root.stat().st_mode) == 0o711
    assert blocking_dir(root, NOBODY, NOBODY) is None


def test_nowhere_reachable_refuses_naming_the_directory_and_the_fix(
    dirs: tuple[Path, Path],
) -> None:
    private, shared = dirs
    (shared / DIR_NAME).mkdir()
    os.chown(shared / DIR_NAME, NOBODY, NOBODY)  # another user's: its owner could swap it
    with pytest.raises(WorkRootUnusable) as refused:
        place_work_root(None, NOBODY, NOBODY, candidates=[private, shared])
    message = str(refused.value)
    assert f"{private} (mode 0700, owner uid 0) does not let the sandbox user" in message
    assert f"{shared / DIR_NAME} belongs to uid {NOBODY}" in message
    assert "set TMPDIR to a directory" in message


def test_a_root_made_under_a_strict_umask_is_opened_to_the_sandbox_user(
    dirs: tuple[Path, Path],
) -> None:
    _, shared = dirs
    (shared / DIR_NAME).mkdir(mode=0o700)
    root = place_work_root(None, NOBODY, NOBODY, candidates=[shared])
    assert stat.S_IMODE(root.stat().st_mode) == 0o711


@pytest.mark.sandbox
def test_a_configured_work_root_out_of_reach_refuses_the_sandbox(
    dirs: tuple[Path, Path],
) -> None:
    private, shared = dirs
    with pytest.raises(SandboxUnavailable, match=f"work root {private / 'work'} cannot be used"):
        Sandbox(SandboxConfig(work_root=private / "work"))
    reachable = Sandbox(SandboxConfig(work_root=shared / "work"))
    check_sandbox(reachable)  # the probe runs as the sandbox user there
    reachable.close()


@pytest.mark.sandbox
def test_a_sandbox_that_cannot_run_anything_refuses_at_the_probe() -> None:
    with pytest.raises(SandboxUnavailable, match=r"every item would be an infra error\. "
                                                 r"Work dirs are under /"):  # fmt: skip
        open_checked(SandboxConfig(bwrap_path="/bin/false"))  # executable, starts nothing
