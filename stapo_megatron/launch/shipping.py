"""Shipping the code to a Slurm job: ``git archive`` of a checkout, never a stale or partial copy.

The job runs ``git archive`` of the checkout's HEAD (`code_packager`; the checkout is `code_root`,
whatever directory nemo-run is started from). Uncommitted changes (edited or new files that git
does not ignore) would not reach the job: a submission with any is refused by name
(`code_problems`), unless ``--include-uncommitted`` ships the working tree as a commit made with a
temporary index (`snapshot_commit`: no branch, stash or index of the checkout changes).
"""

import os
import subprocess
import tempfile
from typing import List, Optional, Tuple

import nemo_run as run

MAX_LISTED = 20
"""Uncommitted files named in a refusal (the rest are counted)."""


def code_root() -> Optional[str]:
    """The top folder of the git checkout a job's code comes from: ``STAPO_CODE_DIR``, else the
    checkout holding this package; None if that is not in a git checkout."""
    start = os.environ.get("STAPO_CODE_DIR") or os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(["git", "-C", start, "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def code_packager() -> run.Config:
    """``git archive`` of `code_root`'s HEAD (its ``basepath``: the archive does not depend on the
    directory nemo-run is started from; `code_problems` checks for uncommitted changes)."""
    return run.Config(run.GitArchivePackager, basepath=code_root() or "", check_uncommitted_changes=False)


def uncommitted_files(root: str) -> List[str]:
    """``git status --porcelain`` lines of ``root``'s uncommitted changes: modified, added,
    deleted and untracked files (ignored ones are shipped by neither route and not listed)."""
    done = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=all"],
                          capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if line.strip()]


def snapshot_commit(root: str) -> str:
    """A commit of ``root``'s working tree (tracked changes and untracked files git does not
    ignore) on top of HEAD, made with a temporary index: no branch, stash or index of the checkout
    changes. ``git archive`` of it ships what is on disk."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "stapo-megatron", "GIT_AUTHOR_EMAIL": "launch@stapo-megatron",
           "GIT_COMMITTER_NAME": "stapo-megatron", "GIT_COMMITTER_EMAIL": "launch@stapo-megatron"}
    with tempfile.TemporaryDirectory() as tmp:
        env["GIT_INDEX_FILE"] = os.path.join(tmp, "index")

        def git(*args: str) -> str:
            return subprocess.run(["git", "-C", root, *args], env=env, capture_output=True, text=True,
                                  check=True).stdout.strip()

        git("read-tree", "HEAD")
        git("add", "--all")
        tree = git("write-tree")
        return git("commit-tree", tree, "-p", "HEAD", "-m", "stapo-megatron: working tree shipped by nemo-run")


def code_problems(executor, include_uncommitted: bool) -> Tuple[List[str], Optional[str]]:
    """(what keeps ``executor``'s job from getting the checkout's code, the checkout the launch
    must run in or None). Only a Slurm executor with a GitArchivePackager ships code this way;
    with ``include_uncommitted`` the packager's ref becomes a `snapshot_commit`."""
    packager = getattr(executor, "packager", None)
    if not isinstance(executor, run.SlurmExecutor) or not isinstance(packager, run.GitArchivePackager):
        return [], None
    root = packager.basepath or code_root()
    if not root:
        return ["the job's code is shipped with git archive, but this package is not in a git checkout: "
                "launch from a clone (pip install -e .), or set STAPO_CODE_DIR to one"], None
    packager.basepath = root
    changes = uncommitted_files(root)
    if changes and include_uncommitted:
        packager.ref = snapshot_commit(root)
        print(f"# ---- code: the working tree of {root} ({len(changes)} uncommitted changes included; "
              f"commit {packager.ref[:12]} on HEAD) ----", flush=True)
        return [], root
    if changes:
        shown = "; ".join(line.strip() for line in changes[:MAX_LISTED]) + (
            "; ..." if len(changes) > MAX_LISTED else "")
        return [f"{len(changes)} uncommitted changes in {root} would not reach the job (it runs git archive of "
                f"HEAD): {shown}. Commit them, or add --include-uncommitted to ship the working tree"], root
    return [], root
