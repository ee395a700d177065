"""The Python source of one released PyPI file, cached: for contract tests against code that cannot run here.

An `Artifact` names one fixed file of a PyPI project (a wheel or an sdist) and its sha256;
`fetch_source` downloads it once (the sha256 checked against the pin and the index), keeps
only ``<package>/**.py``, the metadata and the listed docs, under
``$XDG_CACHE_HOME/samrollout/<cache>/`` (``~/.cache`` by default), and returns that directory.
``SAMROLLOUT_PYPI_SIMPLE`` points at another simple index (a mirror).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

_COMPLETE = ".complete"


class SourceUnavailable(RuntimeError):
    """The file could not be downloaded or unpacked."""


@dataclass(frozen=True)
class Artifact:
    """One file of a PyPI release and what to keep of it."""

    project: str  # PyPI project name, as in the index URL
    filename: str
    sha256: str
    package: str  # the top-level package whose .py files are kept
    cache: str  # directory under the cache root
    docs: tuple[str, ...] = ()  # other files to keep (paths relative to the project root)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/samrollout`` (``~/.cache/samrollout``)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "samrollout"


def _index_url(project: str) -> str:
    return os.environ.get("SAMROLLOUT_PYPI_SIMPLE", "https://pypi.org/simple").rstrip("/") + f"/{project}/"


def _find_file(artifact: Artifact) -> tuple[str, str]:
    """(url, sha256) of the artifact from the simple index (PEP 691 JSON)."""
    index_url = _index_url(artifact.project)
    request = urllib.request.Request(index_url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        index = json.load(response)
    for entry in index["files"]:
        if entry["filename"] == artifact.filename:
            return entry["url"], entry["hashes"]["sha256"]
    raise SourceUnavailable(f"{artifact.filename} is not in {index_url}")


def _download(artifact: Artifact) -> bytes:
    url, sha256 = _find_file(artifact)
    if sha256 != artifact.sha256:
        raise SourceUnavailable(f"{artifact.filename}: the index lists sha256 {sha256}, expected {artifact.sha256}")
    with urllib.request.urlopen(url, timeout=600) as response:
        data: bytes = response.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise SourceUnavailable(f"{artifact.filename}: sha256 does not match the index")
    return data


def _wanted(artifact: Artifact, name: str) -> bool:
    return ((name.startswith(f"{artifact.package}/") and name.endswith(".py")) or name in artifact.docs
            or name == "PKG-INFO" or name.endswith(".dist-info/METADATA"))


def _members(artifact: Artifact, data: bytes) -> dict[str, bytes]:
    """The wanted members of the wheel or sdist, by path relative to the project root."""
    members: dict[str, bytes] = {}
    if artifact.filename.endswith(".whl"):
        with zipfile.ZipFile(io.BytesIO(data)) as wheel:
            for name in wheel.namelist():
                if _wanted(artifact, name):
                    members[name] = wheel.read(name)
        return members
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as sdist:
        for member in sdist:
            name = member.name.partition("/")[2]  # drop "<project>-<version>/"
            if member.isfile() and _wanted(artifact, name):
                extracted = sdist.extractfile(member)
                assert extracted is not None
                members[name] = extracted.read()
    return members


def _unpack(artifact: Artifact, data: bytes, into: Path) -> None:
    """Write the wanted members under ``into``."""
    members = _members(artifact, data)
    if not any(name.startswith(f"{artifact.package}/") for name in members):
        raise SourceUnavailable(f"{artifact.filename} holds no {artifact.package}/*.py")
    for name, content in members.items():
        if name.startswith("/") or ".." in Path(name).parts:
            raise SourceUnavailable(f"{artifact.filename}: unsafe member {name!r}")
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


def fetch_source(artifact: Artifact) -> Path:
    """The project root of ``artifact`` (``<package>/`` under it), downloading it once.

    Raises `SourceUnavailable` (with the reason) when it cannot be had.
    """
    root = cache_root() / artifact.cache
    if (root / _COMPLETE).exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        try:
            data = _download(artifact)
        except SourceUnavailable:
            raise
        except Exception as error:  # network, HTTP, JSON
            raise SourceUnavailable(f"could not download {artifact.filename} from {_index_url(artifact.project)}: "
                                    f"{error!r}") from error
        _unpack(artifact, data, staging)
        (staging / _COMPLETE).write_text(artifact.filename + "\n")
        if root.exists():  # an unfinished earlier attempt (a finished one returned above)
            shutil.rmtree(root, ignore_errors=True)
        try:
            staging.rename(root)
        except OSError:  # another process got there first
            if not (root / _COMPLETE).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return root


def source_or_fail(artifact: Artifact, name: str) -> Path:
    """`fetch_source` for a contract test: no source (no network) fails the test, naming ``name`` and why."""
    import pytest

    try:
        return fetch_source(artifact)
    except SourceUnavailable as error:
        reason = str(error)
    pytest.fail(f"{name}'s source is needed (PyPI) and could not be had: {reason}", pytrace=False)
