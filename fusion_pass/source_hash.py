"""One fingerprint of this package's code: the sha256 of every Python source of fusion_pass,
its patterns and its kernels. Whatever is derived from that code and kept beyond one process (a
compiled graph in Inductor's FX cache, a traced pattern on disk) is keyed by it."""

from __future__ import annotations

import functools
import hashlib
import pathlib


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 (hex) over the path (below its package folder) and bytes of every ``*.py`` of fusion_pass,
    fusion_pass.patterns and fusion_pass.kernels, in sorted order."""
    import fusion_pass
    import fusion_pass.kernels
    import fusion_pass.patterns

    # patterns/ and kernels/ live outside fusion_pass/ in the source tree (package-dir mapping).
    roots = {
        pathlib.Path(fusion_pass.__file__).parent,
        pathlib.Path(fusion_pass.patterns.__file__).parent,
        pathlib.Path(fusion_pass.kernels.__file__).parent,
    }
    digest = hashlib.sha256()
    for root in sorted(roots):
        for path in sorted(root.rglob("*.py")):
            digest.update(f"{root.name}/{path.relative_to(root)}".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
