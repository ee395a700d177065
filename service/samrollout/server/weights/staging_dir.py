"""The staging root of pushed weights is private to the server: its own directory, mode 0700, no symbolic link.

Staged files are hashed when they arrive and loaded when the upload is committed.  A directory
another local user made, owns or can write to would let that user swap a staged file between
the two (or point the server's writes elsewhere through a symbolic link).  `private_staging_root`
creates the root with mode 0700 when it is missing and otherwise refuses, at start-up, a root
that is a symbolic link, not a directory, owned by another user, or open to its group or others.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

FLAG = "--weight-staging-dir"


class StagingDirError(RuntimeError):
    """The staging root is not private to this server: the message says why and what to do."""


def private_staging_root(root: Path) -> Path:
    """``root``, created with mode 0700 if missing; StagingDirError unless it is a private directory of this user.

    Its parents are created as usual (the umask's mode); only ``root`` itself must be private.
    """
    root.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    _check_private(root, os.lstat(root))
    return root


def _check_private(root: Path, info: os.stat_result) -> None:
    """StagingDirError naming the first way ``root`` (as ``info`` describes it, not followed) is not private."""
    shown = str(root)
    if stat.S_ISLNK(info.st_mode):
        raise StagingDirError(
            f"the weight staging directory {shown} is a symbolic link: staged weights must stay in a directory of "
            f"this server's own; remove the link (the server then creates the directory, mode 0700) or set {FLAG} "
            "to a directory of its own")
    if not stat.S_ISDIR(info.st_mode):
        raise StagingDirError(f"the weight staging directory {shown} is not a directory: remove it or set {FLAG}")
    user = os.geteuid()
    if info.st_uid != user:
        raise StagingDirError(
            f"the weight staging directory {shown} is owned by uid {info.st_uid}, not by this server's user (uid "
            f"{user}): its owner could swap staged weights before they load; remove it (the server then creates it, "
            f"mode 0700) or set {FLAG} to a directory this user owns")
    if info.st_mode & 0o077:
        raise StagingDirError(
            f"the weight staging directory {shown} is open to its group or others (mode "
            f"{stat.S_IMODE(info.st_mode):04o}): they could swap staged weights before they load; run "
            f"`chmod 700 {shown}`, or remove it (the server then creates it, mode 0700)")
