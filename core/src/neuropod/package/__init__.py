"""The on-disk package format: read and write, directory or zip.

A package is the original Neuropod 0.3 layout, which we read unchanged::

    config.json        name, platform, platform_version_semver, input_spec,
                       output_spec, custom_ops, input_tensor_device
    0/config.json      backend-specific settings
    0/data/            the model files
    0/ops/             custom-op libraries, loaded before the model

Packages we write add, without breaking that layout:

* ``manifest.json``: ``{"manifest_version": 1, "files": {relpath: sha256}}``
  for every other file. It is checked on load; a package that we wrote
  (its config has ``exported_with``) must have one. Original 0.3 packages
  have none and are read as they are.
* ``exported_with`` in ``config.json``: the exact framework version and the
  neuropod version that made the package, and ``device_requirements`` when
  the model needs a particular kind of device.
* ``test_data/inputs.npz`` and ``test_data/expected.npz``: test data stored
  without pickle. The original's ``test_data.pkl`` is read only when the
  caller says it trusts the package, because unpickling runs code.

What a package may contain: regular files and directories only. A symbolic
link, FIFO, device or socket anywhere in a directory package is refused with
a ``PackageError`` naming it, before any file is opened (a FIFO would block
the hash forever, a link to ``/dev/zero`` never end it); links are refused
even when they point inside the package, as they are in zips, so that what is
hashed, zipped and loaded is one set of bytes. Files are opened with
``O_NOFOLLOW | O_NONBLOCK`` and checked again after opening, so a file
swapped for a FIFO after the check is refused too.

Zip packages are written deterministically (sorted members, fixed times and
permissions), so the same model gives the same bytes, under a temporary name
unique to the writer and moved into place only when complete. They are
extracted once into a cache keyed by the zip's content hash
(:mod:`neuropod.cache` says what the cache trusts and how an entry is
checked), refusing absolute paths, ``..``, links, duplicate names, encrypted
members, more than ``NEUROPOD_MAX_PACKAGE_BYTES`` (default 32 GiB) of
uncompressed data and more than ``NEUROPOD_MAX_PACKAGE_FILES`` (default
100000) members. A damaged member is a ``PackageError`` naming the zip and
the member. Loading a zip that is in the cache reads the zip once to hash it
and stats the extracted files: they are not read again, and the manifest is
checked against the hashes taken when they were extracted.

The JSON files of a package are read with bounded depth and size
(:mod:`neuropod._json`): a config nested 100000 deep is a ``PackageError``,
never a ``RecursionError`` that breaks the next load. ``manifest_version`` 1
is the only version this neuropod reads.
"""

from __future__ import annotations

from neuropod.cache import DEFAULT_MAX_PACKAGE_BYTES, DEFAULT_MAX_PACKAGE_FILES, cache_dir, verify_cache
from neuropod.package.config import (
    CONFIG,
    LEGACY_TEST_DATA,
    MANIFEST,
    MANIFEST_VERSION,
    REQUIREMENTS_LOCK,
    TEST_EXPECTED,
    TEST_INPUTS,
    ModelConfig,
    parse_config,
    parse_output_labels,
)
from neuropod.package.read import Package, extract_zip, list_files, read_package
from neuropod.package.write import FileSource, make_manifest, replace_package, write_package, write_zip

__all__ = [
    "CONFIG",
    "DEFAULT_MAX_PACKAGE_BYTES",
    "DEFAULT_MAX_PACKAGE_FILES",
    "LEGACY_TEST_DATA",
    "MANIFEST",
    "MANIFEST_VERSION",
    "REQUIREMENTS_LOCK",
    "TEST_EXPECTED",
    "TEST_INPUTS",
    "FileSource",
    "ModelConfig",
    "Package",
    "cache_dir",
    "extract_zip",
    "list_files",
    "make_manifest",
    "parse_config",
    "parse_output_labels",
    "read_package",
    "replace_package",
    "verify_cache",
    "write_package",
    "write_zip",
]
