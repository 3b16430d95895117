"""``neuropod cache``: verify and prune the package cache and the download cache."""

from __future__ import annotations

import argparse
from typing import TextIO

from neuropod.cli.output import EXIT_TEST_FAILED
from neuropod.errors import NeuropodError


def cmd_cache_verify(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod import storage  # lazy: numpy, kept out of `neuropod --help`
    from neuropod.package import cache_dir, verify_cache  # lazy: numpy, kept out of `neuropod --help`

    found = False
    for what, where, problems, again in (
        ("Package cache", cache_dir() / "packages", verify_cache(repair=args.repair), "each zip is extracted again"),
        ("Download cache", storage.downloads_dir(), storage.verify_downloads(repair=args.repair),
         "each package is downloaded again"),
    ):  # fmt: skip
        if not problems:
            print(f"{what} {where}: every entry matches its record", file=out)
            continue
        found = True
        print(f"{what} {where}: {len(problems)} problem(s):", file=out)
        for line in problems:
            print(f"  {line}", file=out)
        if args.repair:
            print(f"Removed what was wrong; {again} the next time it is loaded.", file=out)
        else:
            print(f"Run `neuropod cache verify --repair` to remove them ({again} when next loaded).", file=out)
    return EXIT_TEST_FAILED if found and not args.repair else 0


def cmd_cache_prune(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod import cache, storage  # lazy: numpy, kept out of `neuropod --help`

    if not args.days >= 0:  # also NaN, which compares false with everything
        raise NeuropodError(f"--days must be a number >= 0, not {args.days:g}")
    gone = storage.prune_downloads(args.days, dry_run=args.dry_run)
    verb = "Would remove" if args.dry_run else "Removed"
    trash = sum(1 for path, _, _ in gone if path.name.startswith(cache.TRASH_PREFIX))
    for path, url, size in gone:
        # No URL recorded: a partial download (what an interrupted download left), or what a removal
        # killed half-way left (a .trash- folder).
        left = "removal" if path.name.startswith(cache.TRASH_PREFIX) else "download"
        print(f"{verb} {url} ({size:,} bytes, {path})" if url else f"{verb} {path} ({size:,} bytes, left by an "
              f"interrupted {left})", file=out)  # fmt: skip
    total = sum(size for _, _, size in gone)
    partial = sum(1 for _, url, _ in gone if not url) - trash
    interrupted = f" and {partial} partial one(s) of interrupted downloads" if partial else ""
    if trash:
        interrupted += f" and {trash} folder(s) of interrupted removals"
    print(f"{verb} {len(gone) - partial - trash} download(s) unused for {args.days:g} day(s){interrupted}, "
          f"{total:,} bytes, from {storage.downloads_dir()}", file=out)  # fmt: skip
    return 0
