"""The extraction cache: each zip package unpacked once, keyed by the zip's sha256.

The cache is a performance device, not a source of truth. Layout::

    $NEUROPOD_CACHE_DIR/packages/<sha256 of the zip>/
        files/         the zip's members, extracted
        record.json    written last: the zip's sha256 and every file's size,
                       mtime_ns and sha256

What it trusts, and why:

* An entry is only ever made from bytes whose hash is its key: on a miss the
  zip is copied, through the descriptor it was hashed from, into a private
  unnamed file while being hashed again, and the entry is extracted from that
  copy. Replacing or rewriting the zip in between cannot put another model
  under the key.
* Entries are built under a temporary name, their data synced, the record
  written last, and renamed into place whole. A reader never sees a partial
  entry; an entry without a valid record is not an entry.
* Each load checks, cheaply, that the record names this zip's hash and that
  the entry holds exactly the recorded files, as regular files, with the
  recorded sizes and modification times (a stat per file, no reading). An
  entry that fails (a file edited, deleted or added, an empty directory, a
  file where the directory should be, no record) is extracted again and
  replaced atomically: never an error, never the wrong model.
* The cheap check cannot see a file rewritten with its size kept and its
  mtime put back, nor a record rewritten to match. Who can write the cache
  directory can change the models it serves, so it is created private
  (mode 0700) and must stay so. :func:`verify_cache` re-hashes every file of
  every entry on demand (``neuropod cache verify``) and can remove the bad ones.

Limits on what a zip may unpack to, checked against the headers before
anything is written and against the real output while writing (headers can
lie): ``NEUROPOD_MAX_PACKAGE_BYTES`` (default 32 GiB) of uncompressed data and
``NEUROPOD_MAX_PACKAGE_FILES`` (default 100000) members. Any failure, an
interrupt included, removes what was extracted.
"""

from neuropod.cache.entries import FILES as FILES
from neuropod.cache.entries import (
    HEX64,
    STALE_SECONDS,
    TRASH_PREFIX,
    ZIP_READ_ERRORS,
    Entry,
    FileRecord,
    cache_dir,
    entry_lock,
    extract,
    make_private_dir,
    remove_path,
    verify_cache,
)
from neuropod.cache.entries import RECORD as RECORD
from neuropod.cache.limits import (
    DEFAULT_MAX_PACKAGE_BYTES,
    DEFAULT_MAX_PACKAGE_FILES,
    max_package_bytes,
    max_package_files,
)
from neuropod.cache.limits import check_limit_argument as check_limit_argument
from neuropod.cache.regular_files import file_kind, open_regular, scan_tree, sha256_file
from neuropod.cache.regular_files import hash_stream as hash_stream

__all__ = [
    "DEFAULT_MAX_PACKAGE_BYTES",
    "DEFAULT_MAX_PACKAGE_FILES",
    "Entry",
    "FileRecord",
    "HEX64",
    "STALE_SECONDS",
    "TRASH_PREFIX",
    "ZIP_READ_ERRORS",
    "cache_dir",
    "entry_lock",
    "extract",
    "file_kind",
    "make_private_dir",
    "max_package_bytes",
    "max_package_files",
    "open_regular",
    "remove_path",
    "scan_tree",
    "sha256_file",
    "verify_cache",
]
