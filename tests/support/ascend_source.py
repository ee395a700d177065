"""The Python source of a vllm-ascend release, from PyPI, cached: for contract tests that cannot import it.

vllm-ascend needs torch_npu and an NPU to import, so tests read its source instead.  Each
supported version comes from one fixed PyPI file (tests/support/pypi_source.py: sha256 pinned and
checked); only the ``vllm_ascend/**.py`` files, the metadata and the docs page with the version
table are kept, under ``$XDG_CACHE_HOME/samrollout/vllm-ascend/<version>/``, downloaded once.
"""

from __future__ import annotations

from pathlib import Path

from .pypi_source import Artifact, SourceUnavailable, fetch_source

DOCS = ("docs/source/community/versioning_policy.md",)
# version -> file on PyPI.  0.23.0: a wheel (its Python files are the same on every platform);
# 0.23.0.post1 has no wheel, only an sdist (which also carries the docs).
ARTIFACTS = {
    "0.23.0": Artifact("vllm-ascend", "vllm_ascend-0.23.0-cp311-cp311-manylinux_2_34_x86_64.whl",
                       "4f0d25d3b6d8ae85753b53d4bd8d910418865baf413fa779b87012ad1a4a3f87",
                       "vllm_ascend", "vllm-ascend/0.23.0", DOCS),
    "0.23.0.post1": Artifact("vllm-ascend", "vllm_ascend-0.23.0.post1.tar.gz",
                             "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1",
                             "vllm_ascend", "vllm-ascend/0.23.0.post1", DOCS),
}
AscendSourceUnavailable = SourceUnavailable


def ascend_source(version: str) -> Path:
    """The project root of vllm-ascend ``version`` (``vllm_ascend/`` under it), downloading it once.

    Raises `AscendSourceUnavailable` (with the reason) when it cannot be had.
    """
    if version not in ARTIFACTS:
        raise ValueError(f"no source known for vllm-ascend {version}; known: {sorted(ARTIFACTS)}")
    return fetch_source(ARTIFACTS[version])
