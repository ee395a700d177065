"""The Python source of a vllm-ascend release, from PyPI, cached: for contract tests that cannot import it.

vllm-ascend needs torch_npu and an NPU to import, so tests read its source instead.  Each
supported version comes from one fixed PyPI file (its sha256 checked against the index);
only the ``vllm_ascend/**.py`` files, the metadata and the docs page with the version table are
kept, under ``$XDG_CACHE_HOME/samrollout/vllm-ascend/<version>/`` (``~/.cache`` by default),
downloaded once.  ``SAMROLLOUT_PYPI_SIMPLE`` points at another simple index (a mirror).
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
from pathlib import Path

# version -> file on PyPI.  0.23.0: a wheel (its Python files are the same on every platform);
# 0.23.0.post1 has no wheel, only an sdist (which also carries the docs).
ARTIFACTS = {
    "0.23.0": "vllm_ascend-0.23.0-cp311-cp311-manylinux_2_34_x86_64.whl",
    "0.23.0.post1": "vllm_ascend-0.23.0.post1.tar.gz",
}
DOCS = ("docs/source/community/versioning_policy.md",)
_COMPLETE = ".complete"


class AscendSourceUnavailable(RuntimeError):
    """The release could not be downloaded or unpacked."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "samrollout" / "vllm-ascend"


def _index_url() -> str:
    return os.environ.get("SAMROLLOUT_PYPI_SIMPLE", "https://pypi.org/simple").rstrip("/") + "/vllm-ascend/"


def _find_file(filename: str) -> tuple[str, str]:
    """(url, sha256) of ``filename`` from the simple index (PEP 691 JSON)."""
    request = urllib.request.Request(_index_url(), headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        index = json.load(response)
    for entry in index["files"]:
        if entry["filename"] == filename:
            return entry["url"], entry["hashes"]["sha256"]
    raise AscendSourceUnavailable(f"{filename} is not in {_index_url()}")


def _download(filename: str) -> bytes:
    url, sha256 = _find_file(filename)
    with urllib.request.urlopen(url, timeout=300) as response:
        data: bytes = response.read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise AscendSourceUnavailable(f"{filename}: sha256 does not match the index")
    return data


def _wanted(name: str) -> bool:
    return ((name.startswith("vllm_ascend/") and name.endswith(".py")) or name in DOCS or name == "PKG-INFO"
            or name.endswith(".dist-info/METADATA"))


def _unpack(filename: str, data: bytes, into: Path) -> None:
    """Write the wanted members (paths relative to the project root) under ``into``."""
    members: dict[str, bytes] = {}
    if filename.endswith(".whl"):
        with zipfile.ZipFile(io.BytesIO(data)) as wheel:
            for name in wheel.namelist():
                if _wanted(name):
                    members[name] = wheel.read(name)
    else:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as sdist:
            for member in sdist.getmembers():
                name = member.name.partition("/")[2]  # drop "vllm_ascend-<version>/"
                if member.isfile() and _wanted(name):
                    extracted = sdist.extractfile(member)
                    assert extracted is not None
                    members[name] = extracted.read()
    if not any(name.startswith("vllm_ascend/") for name in members):
        raise AscendSourceUnavailable(f"{filename} holds no vllm_ascend/*.py")
    for name, content in members.items():
        if name.startswith("/") or ".." in Path(name).parts:
            raise AscendSourceUnavailable(f"{filename}: unsafe member {name!r}")
        target = into / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


def ascend_source(version: str) -> Path:
    """The project root of vllm-ascend ``version`` (``vllm_ascend/`` under it), downloading it once.

    Raises `AscendSourceUnavailable` (with the reason) when it cannot be had.
    """
    if version not in ARTIFACTS:
        raise ValueError(f"no source known for vllm-ascend {version}; known: {sorted(ARTIFACTS)}")
    root = cache_root() / version
    if (root / _COMPLETE).exists():
        return root
    filename = ARTIFACTS[version]
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=root.parent))
    try:
        try:
            data = _download(filename)
        except AscendSourceUnavailable:
            raise
        except Exception as error:  # network, HTTP, JSON
            raise AscendSourceUnavailable(f"could not download {filename} from {_index_url()}: {error!r}") from error
        _unpack(filename, data, staging)
        (staging / _COMPLETE).write_text(filename + "\n")
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
