"""What scripts/setup.sh still has to do, decided in one testable place (standard library
only; run with the virtual environment's python).

    python scripts/setup_check.py requirements FILE   exit 0 when FILE's requirements are met
    python scripts/setup_check.py stamp               print the build stamp of this tree
    python scripts/setup_check.py build-needed STAMP_FILE
                                                      exit 0 when the extensions need a build

The build stamp is a hash of every file under csrc/, setup.py, the installed torch version and
the build-time AFDEP_* variables: the extensions are rebuilt exactly when one of these changed
(or the built modules are missing), so a second set-up run takes seconds.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import os
import sys
from typing import Mapping, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The build-time variables that change what setup.py builds (torch_afdep/env.py documents them).
BUILD_VARIABLES = ("AFDEP_BUILD_CUDA", "AFDEP_CUDA_ARCH", "AFDEP_NCCL", "AFDEP_NCCL_HOME",
                   "AFDEP_PTXAS_V")


def _installed_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def requirements_met(path: str) -> bool:
    """Whether every requirement line of ``path`` is installed at an allowed version
    (``pip``'s own vendored parser, so no extra package is needed)."""
    from pip._vendor.packaging.requirements import Requirement

    with open(path) as f:
        lines = [ln.split("#", 1)[0].strip() for ln in f]
    for line in filter(None, lines):
        req = Requirement(line)
        version = _installed_version(req.name)
        if version is None or not req.specifier.contains(version, prereleases=True):
            return False
    return True


def source_files(root: str = ROOT) -> list:
    """The files a build depends on: everything under csrc/ (no caches) and setup.py."""
    found = [p for p in glob.glob(os.path.join(root, "csrc", "**", "*"), recursive=True)
             if os.path.isfile(p) and "__pycache__" not in p]
    return sorted(found) + [os.path.join(root, "setup.py")]


def stamp(root: str = ROOT, torch_version: Optional[str] = None,
          environ: Optional[Mapping[str, str]] = None) -> str:
    """Hash of the build inputs: source paths and contents, torch's version, build variables."""
    environ = os.environ if environ is None else environ
    if torch_version is None:
        torch_version = _installed_version("torch") or "none"
    h = hashlib.sha256()
    for path in source_files(root):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read() + b"\0")
    h.update(f"torch={torch_version}\0".encode())
    for name in BUILD_VARIABLES:
        h.update(f"{name}={environ.get(name, '')}\0".encode())
    return h.hexdigest()


def extensions_present(root: str = ROOT) -> bool:
    """Whether the built c10d backend sits in the package (the CUDA one is optional)."""
    return bool(glob.glob(os.path.join(root, "torch_afdep", "_C.*.so")))


def build_needed(stamp_file: str, root: str = ROOT, torch_version: Optional[str] = None,
                 environ: Optional[Mapping[str, str]] = None) -> bool:
    """True unless ``stamp_file`` holds this tree's stamp and the extensions are built."""
    if not extensions_present(root) or not os.path.exists(stamp_file):
        return True
    with open(stamp_file) as f:
        return f.read().strip() != stamp(root, torch_version, environ)


def main(argv) -> int:
    if len(argv) == 2 and argv[0] == "requirements":
        return 0 if requirements_met(argv[1]) else 1
    if argv == ["stamp"]:
        print(stamp())
        return 0
    if len(argv) == 2 and argv[0] == "build-needed":
        return 0 if build_needed(argv[1]) else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
