"""Packages in object stores and on web servers: ``load_neuropod("s3://bucket/adder.neuropod")``.

A package URL names a zip (an object) or a package directory (a prefix:
``s3://bucket/models/adder/``) in S3 (``s3://``), Google Cloud Storage
(``gs://``), Azure (``az://``, ``abfs://``, ``abfss://``), or a zip on a web
server (``https://`` and ``http://`` URLs whose path ends in ``.zip`` or
``.neuropod``; any other http URL is a model on a server, see
:mod:`neuropod.remote`). The filesystems are fsspec's (s3fs, gcsfs, adlfs,
aiohttp for http), installed by the core's extras (``neuropod[s3]``,
``neuropod[gcs]``, ``neuropod[azure]``, ``neuropod[http]``); the core
itself imports none of them until a URL is loaded.

Downloads live in the cache (:func:`neuropod.cache.cache_dir`)::

    downloads/<key>/
        package.zip    the object, or
        package/       the prefix's files
        record.json    written last: the URL (no credentials, no query),
                       what identified the object, each file's size

The key is the sha256 of the URL (its query too, less the parameters that
only sign it: a presigned URL signed again is the same package, see
:func:`~neuropod.storage.urls.download_url`) and what the store says identifies the
object's content: its ETag, version id, generation or MD5 and its size (a
directory: those of every file under it). A load whose object still has the
same identity takes the download already made, without reading it again; a
changed object has a new key, so it is downloaded again. An object without
any of them (a web server that sends no ETag nor Last-Modified) is
downloaded on every load.

A download is streamed to a partial file in chunks (memory stays a few chunks),
retried from where it stopped when the connection fails, checked against
the store's identity once complete (an object rewritten meanwhile is fetched
again), then renamed into place with its record last: an interrupted or
concurrent download never leaves anything a later load would take. Processes
fetching the same object wait for one another (a lock per key); a partial
file left by a killed one is resumed by the next (``neuropod cache prune`` and
``cache verify --repair`` remove one nothing wrote in for an hour). The package's manifest is
checked by the load itself, as for a local package.

Credentials come from each filesystem's own chain (environment variables,
config files, instance metadata) or ``storage_options``; neither the URL's
user, password and query nor any option is logged or written to the cache
(every URL in a message, the store's own words included, passes through
:func:`~neuropod.storage.urls.redact`).
"""

from neuropod.storage.downloads import downloads_dir, fetch, list_objects, prune_downloads, verify_downloads
from neuropod.storage.stores import CHUNK as CHUNK
from neuropod.storage.stores import object_identity
from neuropod.storage.transfer import ATTEMPTS as ATTEMPTS
from neuropod.storage.transfer import FIRST_WAIT_S as FIRST_WAIT_S
from neuropod.storage.transfer import PARALLEL as PARALLEL
from neuropod.storage.transfer import READ_AHEAD_WAIT_S as READ_AHEAD_WAIT_S
from neuropod.storage.urls import PACKAGE_SUFFIXES, SCHEMES, as_downloaded, is_package_url, shown

__all__ = [
    "PACKAGE_SUFFIXES", "SCHEMES", "as_downloaded", "downloads_dir", "fetch", "is_package_url", "list_objects",
    "object_identity", "prune_downloads", "shown", "verify_downloads",
]  # fmt: skip
