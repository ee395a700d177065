"""Weights pushed over HTTP, staged on the server's own disk until committed: weight updates without a shared disk.

A trainer that shares no file system with the server opens an upload (`WeightUploads.create`),
sends each ``*.safetensors`` file (`WeightUploads.receive`: streamed to disk in blocks of a few
MiB, never held whole in memory, its SHA-256 checked once it is complete), then commits: the
admin routes hand the staged directory to the same checks and the same load as
``POST /admin/update_weights`` (`ServerRuntime.load_weights`) and delete the upload, whatever
the outcome.

Bounds, each a clear error: at most ``max_uploads`` uploads open at once (429) and at most
``max_bytes`` staged by one upload (413), so the staging disk holds at most their product;
an upload untouched for ``idle_seconds`` expires and its files are deleted (`expire`, which
the app runs periodically).  A full disk is a 507.  Each server stages below its own
directory, ``server-<host>-<pid>-<random>`` under the staging root, deleted at shutdown; one
left behind by a server of this host that no longer runs (killed) is deleted at the next start.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import math
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from samrollout.models import cache_root
from samrollout.server.errors import ApiError
from samrollout.server.weights.weights_check import DTYPE_BITS, Layout
from samrollout_client.protocol.weight_uploads import SHA256_HEADER

logger = logging.getLogger("samrollout.server")

STAGING_SUBDIR = "weight-uploads"  # under the server's cache (SAMROLLOUT_CACHE), unless --weight-staging-dir is set
FILE_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}\.safetensors"  # a plain name: no directory, no dot file
UNKNOWN_MODEL_MAX_BYTES = 64 * 2**30  # default upload bound when the served checkpoint's size is unknown
HEADER_ALLOWANCE_BYTES = 64 * 2**20   # added to the default bound: headers of any sharding, metadata
WRITE_BLOCK_BYTES = 4 * 2**20         # received bytes gathered before one write + hash, off the event loop
_FILE_NAME = re.compile(FILE_NAME_PATTERN)
_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHOWN_CHARS = 80


def default_staging_root() -> Path:
    """Where uploads are staged unless configured: ``weight-uploads`` under the server's own cache directory
    (``$SAMROLLOUT_CACHE``, else ``~/.cache/samrollout``), never a shared folder such as the system temp dir."""
    return cache_root() / STAGING_SUBDIR


def staging_root(weight_staging_dir: str | None) -> Path:
    """The staging root a server uses: ``--weight-staging-dir`` when set, else `default_staging_root`."""
    return Path(weight_staging_dir) if weight_staging_dir else default_staging_root()


def default_max_bytes(layout: Layout | None) -> int:
    """The default bound of one upload: twice the served checkpoint's tensor bytes plus 64 MiB.

    One push of the served layout needs its tensor bytes plus the files' headers; twice
    leaves room to send a file again within one upload.  Without a layout (the model is not
    a local safetensors directory) the size is unknown: 64 GiB.
    """
    if layout is None:
        return UNKNOWN_MODEL_MAX_BYTES
    tensor_bytes = sum(math.prod(shape) * DTYPE_BITS[dtype] // 8 for shape, dtype in layout.values())
    return 2 * tensor_bytes + HEADER_ALLOWANCE_BYTES


def _shown(text: str) -> str:
    """A client-given string for a message: quoted, and cut when long."""
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")


def check_file_name(name: str) -> None:
    """ApiError 400 unless ``name`` is a plain ``*.safetensors`` file name (no path, no traversal, no dot file)."""
    if not _FILE_NAME.fullmatch(name):
        raise ApiError(400, f"bad file name {_shown(name)}: a weight file is named like model-00001.safetensors "
                       f"(letters, digits, '.', '_', '-'; no directories; matching {FILE_NAME_PATTERN})", "file_name")


def _checked_sha256(value: str | None) -> str:
    """The client's hex SHA-256 of the file, lower-cased; ApiError 400 when it is missing or malformed."""
    digest = (value or "").strip().lower()
    if not _SHA256.fullmatch(digest):
        raise ApiError(400, f"send the file's SHA-256 as 64 hex digits in the {SHA256_HEADER} header "
                       f"(got {_shown(value) if value else 'none'})", SHA256_HEADER)
    return digest


def _write_block(handle: BinaryIO, hasher: Any, data: bytearray) -> None:
    """Hash and write one block (runs in a worker thread; hashlib releases the GIL on large blocks)."""
    hasher.update(data)
    handle.write(data)


@dataclass
class Upload:
    """One open upload: its directory, the files received whole, and what is streaming in now."""

    upload_id: str
    folder: Path
    touched: float                                                    # clock time of its last activity
    files: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (bytes, sha256), complete files
    incoming: int = 0         # bytes of files still streaming in
    writers: int = 0          # PUTs streaming now
    committing: bool = False
    closed: bool = False      # committed, cancelled or expired: a PUT still streaming stops

    @property
    def staged_bytes(self) -> int:
        """Bytes on disk for this upload: complete files and files still arriving."""
        return sum(size for size, _ in self.files.values()) + self.incoming


class WeightUploads:
    """The server's open uploads and their staging directory (see the module docstring)."""

    def __init__(self, root: Path, max_bytes: int, max_uploads: int, idle_seconds: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Stage under a new directory of this server below ``root`` (created if missing); OSError if impossible."""
        self.max_bytes, self.max_uploads, self.idle_seconds = max_bytes, max_uploads, idle_seconds
        self._clock = clock
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(root)
        self.folder = Path(tempfile.mkdtemp(prefix=f"server-{_host()}-{os.getpid()}-", dir=root))  # mode 0700
        self._uploads: dict[str, Upload] = {}

    # --- the upload's life ---------------------------------------------------------------------------------------

    def create(self) -> Upload:
        """Open a new upload; ApiError 429 when ``max_uploads`` are open already (after expiring idle ones)."""
        self.expire()
        if len(self._uploads) >= self.max_uploads:
            raise ApiError(429, f"{len(self._uploads)} weight uploads are open already (--max-weight-uploads "
                           f"{self.max_uploads}): commit or cancel one (DELETE /admin/weight_uploads/<id>), or wait "
                           f"until an idle one expires ({self.idle_seconds:g} s without activity)")
        upload_id = secrets.token_hex(16)
        folder = self.folder / upload_id
        folder.mkdir()
        upload = self._uploads[upload_id] = Upload(upload_id, folder, self._clock())
        logger.info("weight upload %s opened", upload_id)
        return upload

    def get(self, upload_id: str) -> Upload:
        """The open upload ``upload_id``; ApiError 404 when there is none."""
        upload = self._uploads.get(upload_id) if _UPLOAD_ID.fullmatch(upload_id) else None
        if upload is None:
            raise ApiError(404, f"no open weight upload {_shown(upload_id)}: it was never opened, or it was "
                           f"committed, cancelled, or expired after {self.idle_seconds:g} s without activity",
                           "upload_id")
        return upload

    async def receive(self, upload_id: str, name: str, chunks: AsyncIterator[bytes], sha256: str | None,
                      declared_bytes: int | None = None) -> dict[str, Any]:
        """Stream one file of the upload to disk and keep it if its SHA-256 is ``sha256``.

        The bytes go to a hidden part file in blocks of `WRITE_BLOCK_BYTES` (hashed and written
        off the event loop) and replace any earlier file of that name only once complete and
        verified.  ``declared_bytes`` (the request's Content-Length) is checked against the
        bound before anything is read; the bytes themselves are counted as they come.
        Errors: 404 (no such upload, or it closed meanwhile), 400 (name, checksum), 409 (being
        committed), 413 (over the bound), 507 (disk full); the part file is deleted on each.
        """
        upload = self.get(upload_id)
        check_file_name(name)
        digest = _checked_sha256(sha256)
        if upload.committing:
            raise ApiError(409, "this upload is being committed: it takes no more files", "upload_id")
        if declared_bytes is not None and upload.staged_bytes + declared_bytes > self.max_bytes:
            raise self._too_large(upload, name, declared_bytes)
        upload.writers += 1
        upload.touched = self._clock()
        part = upload.folder / f".{name}.{secrets.token_hex(4)}.part"
        try:
            received, found = await self._write_part(upload, name, part, chunks)
            if upload.closed:
                raise ApiError(404, f"weight upload {upload_id} was cancelled or expired while {name} was being "
                               "received", "upload_id")
            if found != digest:
                raise ApiError(400, f"{name}: the {received} bytes received have SHA-256 {found}, the "
                               f"{SHA256_HEADER} header says {digest}: the file was damaged on the way or the "
                               "checksum is not this file's; send it again", SHA256_HEADER)
            part.replace(upload.folder / name)
            upload.files[name] = (received, digest)
        except OSError as error:
            if error.errno == errno.ENOSPC:
                raise ApiError(507, f"the weight staging disk is full ({self.folder}): {name} not staged; free "
                               "space or point --weight-staging-dir at a larger disk") from None
            raise
        finally:
            upload.writers -= 1
            upload.touched = self._clock()
            part.unlink(missing_ok=True)
        logger.info("weight upload %s: %s staged (%d bytes)", upload_id, name, received)
        return {"upload_id": upload_id, "file": name, "bytes": received, "sha256": digest,
                "upload_bytes": upload.staged_bytes}

    async def _write_part(self, upload: Upload, name: str, part: Path,
                          chunks: AsyncIterator[bytes]) -> tuple[int, str]:
        """``chunks`` into the part file, in blocks of `WRITE_BLOCK_BYTES` hashed and written off the event loop,
        until they end or the upload closes; (bytes received, their SHA-256).  The bytes count against the bound
        (in ``upload.incoming``) while they arrive: 413 as soon as the upload goes over it."""
        received, hasher = 0, hashlib.sha256()
        try:
            with part.open("wb") as handle:
                block = bytearray()
                async for chunk in chunks:
                    if upload.closed:
                        break
                    upload.incoming += len(chunk)
                    received += len(chunk)
                    upload.touched = self._clock()
                    if upload.staged_bytes > self.max_bytes:
                        raise self._too_large(upload, name, received)
                    block += chunk
                    if len(block) >= WRITE_BLOCK_BYTES:
                        data, block = block, bytearray()
                        await asyncio.to_thread(_write_block, handle, hasher, data)
                if block and not upload.closed:
                    await asyncio.to_thread(_write_block, handle, hasher, block)
            return received, hasher.hexdigest()
        finally:
            upload.incoming -= received

    def begin_commit(self, upload_id: str) -> Upload:
        """Mark the upload as being committed (no more files, no cancel, no expiry) and return it.

        ApiError 409 while a file is still streaming in or another commit runs; 400 when no
        file has arrived.
        """
        upload = self.get(upload_id)
        if upload.committing:
            raise ApiError(409, "this upload is being committed already", "upload_id")
        if upload.writers:
            raise ApiError(409, f"{upload.writers} file(s) of this upload are still being received: commit once "
                           "every PUT has been answered", "upload_id")
        if not upload.files:
            raise ApiError(400, "this upload holds no files: PUT the *.safetensors files first", "upload_id")
        upload.committing = True
        return upload

    def finish(self, upload: Upload) -> None:
        """The commit is over (loaded or refused): delete the upload and its files."""
        self._discard(upload, "closed by its commit")

    def cancel(self, upload_id: str) -> Upload:
        """Delete an open upload and its files; ApiError 404 if unknown, 409 while it is being committed."""
        upload = self.get(upload_id)
        if upload.committing:
            raise ApiError(409, "this upload is being committed: it can no longer be cancelled", "upload_id")
        self._discard(upload, "cancelled")
        return upload

    def expire(self) -> list[str]:
        """Delete every upload untouched for ``idle_seconds`` (not one being committed); returns their ids."""
        now = self._clock()
        idle = [u for u in self._uploads.values() if not u.committing and now - u.touched >= self.idle_seconds]
        for upload in idle:
            self._discard(upload, f"expired after {self.idle_seconds:g} s without activity")
        return [u.upload_id for u in idle]

    def close(self) -> None:
        """Delete every upload and this server's staging directory (at shutdown)."""
        for upload in list(self._uploads.values()):
            self._discard(upload, "dropped at shutdown")
        shutil.rmtree(self.folder, ignore_errors=True)

    # --- what it holds -------------------------------------------------------------------------------------------

    def open_uploads(self) -> list[Upload]:
        """The uploads open now, oldest first."""
        return list(self._uploads.values())

    def describe(self, upload: Upload) -> dict[str, Any]:
        """One upload as the API shows it: files, bytes, bounds, seconds until it expires if left idle."""
        return {"upload_id": upload.upload_id, "files": {n: size for n, (size, _) in sorted(upload.files.items())},
                "bytes": upload.staged_bytes, "max_bytes": self.max_bytes, "committing": upload.committing,
                "expires_in_s": max(0.0, round(self.idle_seconds - (self._clock() - upload.touched), 3))}

    def status(self) -> dict[str, Any]:
        """Open uploads and staged bytes, for /admin/status."""
        return {"open": len(self._uploads), "staged_bytes": sum(u.staged_bytes for u in self._uploads.values()),
                "max_uploads": self.max_uploads, "max_bytes_per_upload": self.max_bytes}

    # --- helpers -------------------------------------------------------------------------------------------------

    def _too_large(self, upload: Upload, name: str, size: int) -> ApiError:
        others = upload.staged_bytes - upload.incoming
        return ApiError(413, f"{name}: {size} more bytes would take this upload past its bound of {self.max_bytes} "
                        f"bytes ({others} staged in complete files); raise --max-weight-upload-bytes on the server",
                        "file_name")

    def _discard(self, upload: Upload, why: str) -> None:
        upload.closed = True
        self._uploads.pop(upload.upload_id, None)
        shutil.rmtree(upload.folder, ignore_errors=True)
        logger.info("weight upload %s %s; its files are deleted", upload.upload_id, why)


def _host() -> str:
    """This machine's name as it may appear in a directory name."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _running(pid: int) -> bool:
    """Whether another process with this id runs on this machine.

    This process's own id: no.  A directory with it that this process did not make was left
    by an earlier server with the same id (a restarted container keeps its host name, pid
    and volumes).
    """
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_staging(root: Path, keep: Path | None = None) -> list[Path]:
    """Delete the staging directories under ``root`` of servers of this host that no longer run; returns them.

    ``keep``: this server's own directory, once made.
    """
    pattern = re.compile(rf"server-{re.escape(_host())}-(\d+)-\w+")
    stale = []
    for entry in root.iterdir():
        match = pattern.fullmatch(entry.name)
        if (match and entry != keep and entry.is_dir() and not entry.is_symlink()
                and not _running(int(match[1]))):
            shutil.rmtree(entry, ignore_errors=True)
            stale.append(entry)
    if stale:
        logger.info("deleted %d weight staging directories left by servers no longer running", len(stale))
    return stale
