"""The torch versions this package supports, checked when the passes are installed.

The patterns match the post-grad and joint graphs that torch's decompositions produce, and
those change between releases (pytorch#190886: a 2.14 nightly dropped a QK-norm + RoPE match
silently). Below the supported minimum the APIs used here are missing or behave otherwise, so
installing fails loudly; above the newest tested release it warns: fusions may silently not
match (``fusion_pass.report()`` says what matched).
"""

from __future__ import annotations

import warnings

import torch
from torch.torch_version import TorchVersion

#: Oldest torch the passes support (measured on the H200 GPU machine: 2.11.0+cu130).
MIN_TORCH = "2.11"
#: Newest torch release CI ran on: the suite on constraints.txt's torch, a smoke subset on every other
#: minor release from MIN_TORCH up (.ci/torch_matrix).
NEWEST_TESTED_TORCH = "2.15"
SUPPORTED_RANGE = (f"torch >= {MIN_TORCH} (tested: {MIN_TORCH} on CUDA (H200); {MIN_TORCH} to {NEWEST_TESTED_TORCH} "
                   "on CPU in CI)")

_warned: set[str] = set()


class UnsupportedTorchVersion(RuntimeError):
    """The installed torch is older than ``MIN_TORCH``."""


def check_torch_version(version: str | None = None) -> None:
    """Raise ``UnsupportedTorchVersion`` below ``MIN_TORCH``; warn (once per version) above the
    newest tested release.

    Args:
        version: a torch version string such as ``"2.11.0+cu130"``; default ``torch.__version__``.
    """
    found = TorchVersion(torch.__version__ if version is None else version)
    # Compare major.minor only: NVIDIA's containers ship pre-release tags such as 2.11.0a0+git…,
    # which are the 2.11 release for this purpose, and 2.13.1 is the tested 2.13.
    release = TorchVersion(".".join(str(found).split("+")[0].split(".")[:2]))
    if release < MIN_TORCH:
        raise UnsupportedTorchVersion(
            f"fusion_pass: torch {found} is not supported; it needs {SUPPORTED_RANGE}. "
            f"Upgrade torch (pip install 'torch>={MIN_TORCH}')."
        )
    if release > NEWEST_TESTED_TORCH and str(found) not in _warned:
        _warned.add(str(found))
        warnings.warn(
            f"fusion_pass: torch {found} is newer than the newest tested release ({NEWEST_TESTED_TORCH}); "
            f"supported: {SUPPORTED_RANGE}. Fusions may silently not match: check fusion_pass.report().",
            stacklevel=3,
        )
