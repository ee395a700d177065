"""New policy weights checked before the engine sees them: a readable directory of intact safetensors, same layout.

vLLM's weight reload trusts what it is given: random bytes, a truncated file or a tensor of
another shape fail inside the workers and can take the engine down.  `check_weights_dir`
turns every such problem into a `WeightsError` naming the file and the tensor, so
``POST /admin/update_weights`` answers 400 and the old weights keep serving.  The structural
checks read only headers (the 8-byte length and the JSON after it), so they take
milliseconds on any checkpoint; the value check (NaN, infinity; on by default) reads each
tensor once.  Only regular files are opened: a FIFO or device in the directory is refused
from ``stat`` alone.  The server runs the checks off its event loop, bounded in time.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path

from samrollout.server.weights.weight_values import FileTensors, first_non_finite

logger = logging.getLogger("samrollout.server")

TensorSpec = tuple[tuple[int, ...], str]  # shape, safetensors dtype name ("BF16", "F32", ...)
Layout = dict[str, TensorSpec]            # tensor name -> spec

# Bits per element of every dtype the safetensors format defines.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses larger headers
_SHOWN_PATH_CHARS = 160


class WeightsError(ValueError):
    """A weights directory that must not reach the engine; the message says which file and tensor, and why."""


class FileOutsideRoot(WeightsError):
    """A weight file of the directory resolves outside the directories loads may read (``--weights-root``)."""


def _shown(path: str) -> str:
    """``path`` for a message: quoted, and shortened when it is very long."""
    if len(path) <= _SHOWN_PATH_CHARS:
        return repr(path)
    return f"{path[:_SHOWN_PATH_CHARS // 2]!r}...({len(path)} characters)"


def _os_problem(error: OSError) -> str:
    """What an OS error on a path means, in words."""
    denied = "cannot be read: permission denied"
    known = {errno.ENAMETOOLONG: "is too long for the file system", errno.ENOENT: "does not exist",
             errno.ENOTDIR: "is not a directory (a part of it is a file)", errno.EACCES: denied,
             errno.EPERM: denied, errno.ELOOP: "has too many levels of symbolic links"}
    return known.get(error.errno or 0, f"cannot be read: {error.strerror or error}")


def _special_kind(mode: int) -> str | None:
    """What a file that is neither regular nor a directory is ("a FIFO", ...); None for those two."""
    kinds = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), None)


def _weight_files(path: str, allowed: Callable[[Path], bool] | None = None) -> list[Path]:
    """The ``*.safetensors`` files of the directory ``path`` (sorted); WeightsError when there is no such directory.

    Every entry is looked at with ``stat`` only (never opened): a FIFO, device or socket in
    the directory is refused, since reading one can block forever or never end.  ``allowed``:
    where a weight file may resolve (`FileOutsideRoot` for one that does not, before it is stat'ed).
    """
    if "\x00" in path:
        raise WeightsError("the path contains a NUL character")
    folder = Path(path)
    files = []
    try:
        if not stat.S_ISDIR(folder.stat().st_mode):
            raise WeightsError(f"{_shown(path)} is not a directory: give the directory holding the *.safetensors files")
        for entry in sorted(folder.iterdir()):
            if allowed is not None and entry.name.endswith(".safetensors") and not allowed(entry):
                raise FileOutsideRoot(f"{entry.name} is a link to a file outside --weights-root")
            try:
                mode = entry.stat().st_mode  # follows symbolic links: what a reader would open
            except FileNotFoundError:
                mode = entry.lstat().st_mode  # a dangling link: refused below if it names weights
            kind = _special_kind(mode)
            if kind is not None:
                raise WeightsError(f"{entry.name} is {kind}: a weights directory may hold only regular files")
            if entry.name.endswith(".safetensors"):
                if not stat.S_ISREG(mode):
                    raise WeightsError(f"{entry.name} is not a regular file")
                files.append(entry)
    except OSError as error:
        raise WeightsError(f"{_shown(path)} {_os_problem(error)}") from None
    if not files:
        raise WeightsError(f"{_shown(path)} holds no *.safetensors files")
    return files


def _entry_spec(file: str, name: str, entry: object) -> tuple[TensorSpec, int, int]:
    """One header entry's (shape, dtype) and data offsets, checked against each other."""
    if not isinstance(entry, dict):
        raise WeightsError(f"{file}: tensor {name!r} has a malformed header entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise WeightsError(f"{file}: tensor {name!r} has an unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise WeightsError(f"{file}: tensor {name!r} has a malformed shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise WeightsError(f"{file}: tensor {name!r} has malformed data offsets {offsets!r}")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or offsets[1] - offsets[0] != bits // 8:
        raise WeightsError(f"{file}: tensor {name!r} ({dtype} {shape}) needs {math.ceil(bits / 8)} bytes, "
                           f"its offsets give {offsets[1] - offsets[0]}")
    return (tuple(shape), dtype), offsets[0], offsets[1]


def read_header(path: Path) -> Layout:
    """The tensors of one safetensors file (`read_file`'s layout)."""
    return read_file(path)[0]


def read_file(path: Path) -> tuple[Layout, FileTensors]:
    """The tensors of one safetensors file and where their bytes are, after checking that its header describes
    the file exactly.

    The header must be JSON, every tensor's bytes must match its dtype and shape, and the
    tensors must tile the data section, which must end where the file ends: a truncated or
    padded file, or one that is not safetensors at all, is a WeightsError.
    """
    file = path.name
    try:
        # Non-blocking open: should the file have become a FIFO since it was listed, this cannot hang.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise WeightsError(f"{file} is not a regular file")
            size = info.st_size
            if size < 8:
                raise WeightsError(f"{file}: {size} bytes, too short for a safetensors file (empty or truncated)")
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise WeightsError(f"{file} is not a safetensors file, or is truncated: its first 8 bytes announce a "
                                   f"{length}-byte header in a {size}-byte file")
            raw = handle.read(length)
    except OSError as error:
        raise WeightsError(f"{file} {_os_problem(error)}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WeightsError(f"{file} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{file} is not a safetensors file: its header is not a JSON object")
    layout: Layout = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        layout[name], begin, end = _entry_spec(file, name, entry)
        spans.append((begin, end, name))
    tensors = FileTensors(path, 8 + length, [(name, layout[name][1], begin, end) for begin, end, name in spans])
    position = 0
    for begin, end, name in sorted(spans):
        if begin != position:
            raise WeightsError(f"{file}: tensor {name!r} starts at data byte {begin}, expected {position} "
                               "(overlapping tensors or a gap)")
        position = end
    data = size - 8 - length
    if position != data:
        raise WeightsError(f"{file} is truncated or corrupt: its header describes {position} bytes of tensor data, "
                           f"the file holds {data}")
    return layout, tensors


def _library_opens(path: Path) -> None:
    """The safetensors library (what vLLM loads with) opens the file; its own header checks apply."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # SafetensorError and whatever else the library raises on a bad file
        raise WeightsError(f"{path.name}: the safetensors library cannot open it: {error}") from None


def read_directory(path: str, allowed: Callable[[Path], bool] | None = None,
                   ) -> tuple[dict[str, tuple[str, TensorSpec]], list[FileTensors]]:
    """Every tensor of the directory's ``*.safetensors`` files (name -> (file name, spec)), and where each file keeps
    them (for the value check); each file checked whole (``allowed``: as for `_weight_files`)."""
    found: dict[str, tuple[str, TensorSpec]] = {}
    files: list[FileTensors] = []
    for file in _weight_files(path, allowed):
        layout, tensors = read_file(file)
        _library_opens(file)
        files.append(tensors)
        for name, spec in layout.items():
            if name in found:
                raise WeightsError(f"tensor {name!r} is in both {found[name][0]} and {file.name}")
            found[name] = (file.name, spec)
    return found, files


def check_weights_dir(path: str, expected: Layout | None, values: bool = False,
                      allowed: Callable[[Path], bool] | None = None) -> Path:
    """The directory ``path`` once its weights are fit to load in place of the served ones; WeightsError otherwise.

    ``expected``: the served checkpoint's layout (`checkpoint_layout`); every tensor must be
    there with the same shape and dtype, and none may be missing.  None: files are checked,
    the layout is not (the served model is not a local safetensors checkpoint).
    ``values``: also read every floating-point tensor once and refuse NaN or infinite values
    (`weight_values.first_non_finite`), after the headers and layout passed.
    ``allowed``: where each weight file must resolve (`FileOutsideRoot` otherwise; None: anywhere).
    """
    found, files = read_directory(path, allowed)
    if expected is not None:
        _check_layout(found, expected)
    if values:
        finding = first_non_finite(files)
        if finding is not None:
            raise WeightsError(f"{finding}; the served weights are kept")
    return Path(path)


def _check_layout(found: dict[str, tuple[str, TensorSpec]], expected: Layout) -> None:
    """Every tensor of ``expected`` is in ``found`` with its shape and dtype, and nothing else is."""
    for name, (file, (shape, dtype)) in sorted(found.items()):
        want = expected.get(name)
        if want is None:
            raise WeightsError(f"{file}: tensor {name!r} is not in the served model")
        if shape != want[0]:
            raise WeightsError(f"{file}: tensor {name!r} has shape {list(shape)}, "
                               f"the served model's is {list(want[0])}")
        if dtype != want[1]:
            raise WeightsError(f"{file}: tensor {name!r} is {dtype}, the served model's is {want[1]}")
    missing = sorted(set(expected) - set(found))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"tensor {missing[0]!r}{more} of the served model is in none of the *.safetensors files")


def hub_snapshot(model: str, revision: str | None = None, cache_dir: str | None = None) -> str | None:
    """The local directory of hub model ``model`` (its snapshot at ``revision`` in the Hugging Face cache, or in
    ``cache_dir``: vLLM's ``--download-dir``), once downloaded; None when it is not there (or not a hub id)."""
    try:
        from huggingface_hub import snapshot_download

        found: str = snapshot_download(model, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                       allow_patterns=["*.safetensors"])
    except Exception:  # not a hub id, not downloaded, no huggingface_hub: nothing to read the layout from
        return None
    return found


def checkpoint_layout(model_path: str, revision: str | None = None, download_dir: str | None = None) -> Layout | None:
    """The served checkpoint's tensors (name -> shape, dtype), what weight updates must match.

    ``model_path``: a local directory, or a hub id whose snapshot is read from the cache vLLM
    downloaded it to (`hub_snapshot`; ``revision`` and ``download_dir`` as vLLM's).  None when
    neither holds intact safetensors files (another format, or not downloaded yet): updates are
    then checked for intact files only, and the server says so in its log.
    """
    if not os.path.isdir(model_path):
        snapshot = hub_snapshot(model_path, revision, download_dir)
        if snapshot is None:
            logger.warning("weight updates: %s is neither a local directory nor a downloaded hub model; their "
                           "layout (tensor names, shapes, dtypes) will not be checked", model_path)
            return None
        model_path = snapshot
    try:
        return {name: spec for name, (_, spec) in read_directory(model_path)[0].items()}
    except WeightsError as error:
        logger.warning("weight updates: the served checkpoint's layout cannot be read (%s); it will not be checked",
                       error)
        return None
