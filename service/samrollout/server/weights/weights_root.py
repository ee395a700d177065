"""Weights loaded by path confined to one directory (``--weights-root``): a caller names a path, not what it reads.

``POST /admin/update_weights {"path"}`` and AReaL's ``/areal_update_weights {"model_path"}`` make
the server read a directory the caller names.  With ``--weights-root`` set, `WeightsRoot.confine`
resolves the path first (symbolic links followed, ``..`` collapsed, relative to the server's working
directory) and refuses it with a 403 naming the setting unless it lies inside the root; each
``*.safetensors`` file of the directory must resolve inside it too (`WeightsRoot.holds`), so a link
to a file elsewhere is refused the same way.  The refusal is the same whether the path exists or
not, and says nothing of what is there: the checks that read files (`weights_check`) run only on a
path inside the root, and the server then loads the resolved directory, not the name it was given.
Weights pushed over HTTP are staged by the server itself and are not subject to the root.

A caller's path is capped before any work (`check_path_limits`: at most `MAX_PATH_BYTES` in all and
`MAX_NAME_BYTES` per component, as Linux's PATH_MAX and NAME_MAX, no NUL; else a 400 naming the
limit), and the resolution itself reads the filesystem, so the runtime runs `confine` off the event
loop, bounded in time: a long or hostile path costs the caller, never the server's other requests.
"""

from __future__ import annotations

import os
from pathlib import Path

from samrollout.server.errors import ApiError

OUTSIDE = ("is outside --weights-root: this server loads weights by path only from inside its weights root "
           "(symbolic links and '..' resolved); save them there, or push them (/admin/weight_uploads)")


MAX_PATH_BYTES = 4096
"""The longest path a caller may name, in UTF-8 bytes (Linux's PATH_MAX)."""
MAX_NAME_BYTES = 255
"""The longest component of such a path, in UTF-8 bytes (Linux's NAME_MAX)."""


def check_path_limits(path: str, param: str) -> None:
    """ApiError 400 naming the limit unless ``path`` is at most `MAX_PATH_BYTES` bytes, each component at most
    `MAX_NAME_BYTES`, without NUL; cheap (one pass), run before anything reads the path."""
    if "\x00" in path:
        raise ApiError(400, f"weights not loaded: {param} contains a NUL character", param)
    size = len(path.encode("utf-8", "surrogatepass"))
    if size > MAX_PATH_BYTES:
        raise ApiError(400, f"weights not loaded: {param} is {size} bytes long, over the limit of {MAX_PATH_BYTES} "
                       "bytes for a path", param)
    longest = max((len(part.encode("utf-8", "surrogatepass")) for part in path.split("/")), default=0)
    if longest > MAX_NAME_BYTES:
        raise ApiError(400, f"weights not loaded: a component of {param} is {longest} bytes long, over the limit of "
                       f"{MAX_NAME_BYTES} bytes for one name in a path", param)


class WeightsRoot:
    """The directory every load by path must resolve inside (None: any directory the server can read)."""

    def __init__(self, root: str | None) -> None:
        """``root``: ``--weights-root``, resolved now (it must be a directory: ValueError naming the setting)."""
        self.root: Path | None = None
        if root is not None:
            resolved = Path(os.path.realpath(root))
            if not resolved.is_dir():
                raise ValueError(f"--weights-root {root!r} is not a directory")
            self.root = resolved

    def holds(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path``, resolved, lies inside the root (always, without one)."""
        if self.root is None:
            return True
        resolved = Path(os.path.realpath(path))
        return resolved == self.root or self.root in resolved.parents

    def confine(self, path: str, param: str) -> str:
        """The directory to load for the client's ``path``: resolved inside the root, else ApiError 403 naming the
        setting and ``param`` (the request field) and nothing of the path; without a root, ``path`` as given."""
        if self.root is None:
            return path
        if "\x00" in path:
            raise ApiError(400, "weights not loaded: the path contains a NUL character", param)
        if not self.holds(path):
            raise ApiError(403, f"weights not loaded: {param} {OUTSIDE}", param)
        return os.path.realpath(path)
