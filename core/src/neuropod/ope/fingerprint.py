"""What a model's package files were at its first load: a worker restarts only on the same files."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

from neuropod.errors import PackageError
from neuropod.package import Package, read_package


class PackageFingerprint:
    """What the package's files were at the first load, checked before a worker restarts."""

    def __init__(self, package: Package):
        self.package = package
        self.root = package.root
        self.source = package.source
        self.manifest = dict(package.manifest) if package.manifest is not None else None
        self.hashes: dict[str, str] | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if self.manifest is None:
            # Hashed while the workers start, so loading does not wait for it.
            self._thread = threading.Thread(target=self._hash_all, name="neuropod-fingerprint", daemon=True)
            self._thread.start()

    def _hash_all(self) -> None:
        try:
            self.hashes = {rel: _file_sha256(self.root / rel) for rel in self.package.files()}
        except (OSError, PackageError) as e:  # reported by check(): a restart cannot be proven safe
            self.error = e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def check(self, model: str) -> dict[str, tuple[int, int, int]]:
        """Raise a PackageError unless every file is as it was; returns the files' (size, mtime, inode)."""
        self.wait()
        try:
            if self.manifest is not None:
                expected, what = self.manifest, "the manifest read when the model was loaded"
                present = set(self.package.files()) - {"manifest.json"}
            elif self.hashes is not None:
                expected, what = self.hashes, "the files as they were when the model was loaded"
                present = set(self.package.files())
            else:
                raise PackageError(f"its files could not be read when the model was loaded ({self.error})")
            problems = []
            changed = sorted(f for f in present & set(expected) if _file_sha256(self.root / f) != expected[f])
            for label, names in (("changed", changed), ("missing", sorted(set(expected) - present)),
                                 ("added", sorted(present - set(expected)))):  # fmt: skip
                if names:
                    problems.append(f"{label}: {', '.join(names[:20])}" + (" ..." if len(names) > 20 else ""))
            if problems:
                raise PackageError(f"it does not match {what} ({'; '.join(problems)})")
            return self.stats(present)
        except PackageError as e:
            raise PackageError(
                f"Cannot restart the worker for model {model!r}: its package {self.source} (files in {self.root}) "
                f"has changed on disk since the model was loaded: {e}. A restart must serve the model that was "
                "loaded: restore the files, or load the model again to serve them as they are now."
            ) from None

    def stats(self, files: set[str] | None = None) -> dict[str, tuple[int, int, int]]:
        out = {}
        for rel in sorted(files if files is not None else self.package.files()):
            try:
                st = os.stat(self.root / rel)
            except OSError:
                continue
            out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
        return out


def _file_sha256(path: Path) -> str:
    # O_NONBLOCK and the S_ISREG check: a FIFO or device put in place of a file is refused, not waited on.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise PackageError(f"cannot read {path}: {e.strerror}") from None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PackageError(f"{path} is not a regular file")
        h = hashlib.sha256()
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def package_fingerprint(package_root: str, package: Package | None) -> PackageFingerprint:
    """The fingerprint of ``package`` (read from ``package_root`` when None) for a pool that may restart workers."""
    if package is None:
        # Without the Package the client checked, the package on disk now is the nearest to it.
        package = read_package(package_root, verify=False)
    return PackageFingerprint(package)


__all__ = ["PackageFingerprint", "package_fingerprint"]
