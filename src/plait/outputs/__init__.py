"""What plait writes and where: directory ownership, one-run-per-directory locks, pre-launch checks."""

from plait.outputs.lock import DirectoryLock, DirectoryLockedError
from plait.outputs.ownership import OutputDirError

__all__ = ["DirectoryLock", "DirectoryLockedError", "OutputDirError"]
