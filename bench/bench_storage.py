"""Packages loaded by URL from a local S3 server against the same packages on local disk.

    python bench/bench_storage.py [--sizes 1,1024] [--rounds 3] [--s3rver PATH] [--json PATH]

Each S3 server runs in a process of its own on 127.0.0.1: moto's, and s3rver (a
Node.js S3 server storing objects as files, ``npm install s3rver``) when
``--s3rver`` names its command. moto reads the whole object for every range
request it serves; s3rver reads only the range. Each package (a zip holding a
random, incompressible file of the size, in MiB) is uploaded once. For each
server and size, in the same run:

* **raw**: s3fs alone copying the object to a file (``S3FileSystem.get``, what a
  copy step written with s3fs does: one GET, or for an object over its block
  size of 50 MB, ranges of 50 MB, ten at once), as bytes per second;
* **ranged**: s3fs alone copying it as ``aws s3 cp`` does (s3transfer's defaults:
  GETs of 8 MiB ranges, 10 at once, each written at its offset), as bytes per second;
* **cold**: ``neuropod.storage.fetch`` with an empty download cache (the object
  streamed into the cache, synced, checked against the store and put in place),
  as bytes per second. Target: at least 0.8 of raw (and of ranged);
* **warm**: a load by URL whose download is cached (``fetch``, which asks the
  store for the object's identity, then ``read_package`` of the download),
  against ``read_package`` of the same zip on local disk. Target: at most 10 ms
  added. (The backend's own load of the model is the same on both sides and is
  left out.)
* **memory**: a cold ``fetch`` in a fresh process, its peak resident memory over
  what it held before the call. Target: O(chunk), whatever the size: at most
  ``2 * PARALLEL + 4`` chunks, 192 MB with the defaults (each range read in flight,
  twice while the HTTP client joins its body's pieces into one bytes object; the
  one being written; the first chunk, read with the object's identity; what the
  allocator keeps of freed ones).

Medians of ``--rounds`` rounds (warm: 5x more); the two sides alternate in each round.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import add_json_option, record, verdict, write_json
from _servers import free_port

# s3rver's own keys (moto takes any).
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}  # fmt: skip

# A cold fetch in a fresh process: its peak resident memory over what it held before.
CHILD = r"""
import json, sys
from neuropod import storage

def status_mb(field):  # this process's own memory (VmHWM: its peak, which exec started afresh)
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0

import s3fs  # imported before the measure, as a long-running process has it
before = status_mb("VmRSS")
storage.fetch(sys.argv[1], storage_options={"client_kwargs": {"endpoint_url": sys.argv[2]}})
print(json.dumps({"before_mb": before, "peak_mb": status_mb("VmHWM")}))
"""


def _start_s3(server: str, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``server`` ("moto", or the path of s3rver's command) on a free port: (process, endpoint)."""
    port = free_port()
    if server == "moto":
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    else:
        data = work / "s3rver-data"
        data.mkdir(exist_ok=True)
        command = [server, "-d", str(data), "-a", "127.0.0.1", "-p", str(port), "--silent"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the S3 server {server} did not start")


def _package(work: Path, size_mb: int) -> Path:
    """A zip package holding ``size_mb`` MiB of random bytes (deflate cannot shrink them)."""
    from neuropod.package import parse_config, write_package

    blob = work / f"weights-{size_mb}.bin"
    with open(blob, "wb") as f:
        for _ in range(size_mb):
            f.write(os.urandom(1 << 20))
    config = parse_config({"name": f"big{size_mb}", "platform": "opaque", "platform_version_semver": "*",
                           "input_spec": [], "output_spec": [], "input_tensor_device": {}}, "bench")  # fmt: skip
    path = write_package(work / f"big{size_mb}.neuropod", config, {"0/data/weights.bin": blob}, package_as_zip=True,
                         zip_compression=zipfile.ZIP_STORED)  # fmt: skip
    blob.unlink()
    return Path(path)


def _ranged_copy(fs: object, path: str, dest: Path, size: int, part: int = 8 << 20, workers: int = 10) -> None:
    """``aws s3 cp``'s download with s3fs alone: ``workers`` range GETs of ``part`` bytes at once,
    each written at its offset."""
    import concurrent.futures

    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:

        def one(start: int) -> None:
            data = fs.cat_file(path, start=start, end=min(start + part, size))  # type: ignore[attr-defined]
            os.pwrite(fd, data, start)

        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            for done in pool.map(one, range(0, size, part)):
                del done
        os.fsync(fd)
    finally:
        os.close(fd)


def _clear(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,1024", help="package sizes in MiB, comma-separated (default 1,1024)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--s3rver", default=os.environ.get("NEUROPOD_BENCH_S3RVER") or shutil.which("s3rver"),
                    help="s3rver's command (npm install s3rver): measured too when given (default: "
                         "$NEUROPOD_BENCH_S3RVER, or s3rver on PATH)")  # fmt: skip
    ap.add_argument("--servers", default="moto,s3rver", help="which servers to measure (default moto,s3rver)")
    add_json_option(ap)
    args = ap.parse_args()
    os.environ.update(CREDENTIALS)
    import s3fs

    import neuropod

    wanted = set(args.servers.split(","))
    servers = [(n, c) for n, c in (("moto", "moto"), ("s3rver", args.s3rver)) if n in wanted and c]
    print(f"neuropod {neuropod.__version__}, s3fs {s3fs.__version__}, Python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs; S3 servers on 127.0.0.1: {', '.join(n for n, _ in servers)}; {args.rounds} "
          "rounds, medians")  # fmt: skip
    if not args.s3rver:
        print("(s3rver not found: `npm install s3rver@3.7.1` and pass --s3rver to measure a server that reads "
              "only the range asked)")  # fmt: skip
    for name, command in servers:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-storage-") as tmp:
            _measure(name, command, args, Path(tmp))
    write_json(args.json, "storage", {"s3fs": s3fs.__version__})


def _measure(name: str, command: str, args: argparse.Namespace, work: Path) -> None:
    """Every size against one S3 server."""
    import boto3
    import s3fs

    from neuropod import storage
    from neuropod.package import read_package

    print(f"\n{name}:")
    server, endpoint = _start_s3(command, work)
    try:
        os.environ["NEUROPOD_CACHE_DIR"] = str(work / "cache")
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="models")
        options = {"client_kwargs": {"endpoint_url": endpoint}}
        fs = s3fs.S3FileSystem(**options)
        slack_mb = (2 * storage.PARALLEL + 4) * storage.CHUNK / (1 << 20)
        print(f"{'size':>8} {'raw MB/s':>9} {'ranged MB/s':>12} {'cold MB/s':>10} {'cold/raw':>9} "
              f"{'cold/ranged':>12} {'local load':>11} {'by URL':>9} {'added':>9} {'peak growth':>12}")  # fmt: skip
        for size_mb in [int(s) for s in args.sizes.split(",")]:
            zpath = _package(work, size_mb)
            key = zpath.name
            client.upload_file(str(zpath), "models", key)
            url = f"s3://models/{key}"
            nbytes = zpath.stat().st_size
            raw_s, ranged_s, cold_s = [], [], []
            for r in range(args.rounds):
                for side in (("raw", "ranged", "cold") if r % 2 == 0 else ("cold", "ranged", "raw")):
                    if side in ("raw", "ranged"):
                        dest = work / "copy.bin"
                        t0 = time.perf_counter()
                        if side == "raw":
                            fs.get(f"models/{key}", str(dest))
                        else:
                            _ranged_copy(fs, f"models/{key}", dest, nbytes)
                        (raw_s if side == "raw" else ranged_s).append(time.perf_counter() - t0)
                        dest.unlink()
                    else:
                        _clear(storage.downloads_dir())
                        t0 = time.perf_counter()
                        storage.fetch(url, storage_options=options)
                        cold_s.append(time.perf_counter() - t0)
            # Warm: the download above is in the cache; the local zip is the same bytes.
            read_package(zpath)  # both sides' extraction made once, before timing
            read_package(storage.fetch(url, storage_options=options))
            local_s, url_s = [], []
            for r in range(args.rounds * 5):
                for side in (("local", "url") if r % 2 == 0 else ("url", "local")):
                    t0 = time.perf_counter()
                    if side == "local":
                        read_package(zpath)
                        local_s.append(time.perf_counter() - t0)
                    else:
                        read_package(storage.fetch(url, storage_options=options))
                        url_s.append(time.perf_counter() - t0)
            _clear(storage.downloads_dir())
            child = subprocess.run([sys.executable, "-c", CHILD, url, endpoint], capture_output=True, text=True,
                                   timeout=1800, env=dict(os.environ))  # fmt: skip
            if child.returncode != 0:
                raise SystemExit(f"the memory child failed:\n{child.stderr[-3000:]}")
            mem: dict[str, float] = json.loads(child.stdout.strip().splitlines()[-1])
            growth = mem["peak_mb"] - mem["before_mb"]
            raw_bw = nbytes / statistics.median(raw_s) / 1e6
            ranged_bw = nbytes / statistics.median(ranged_s) / 1e6
            cold_bw = nbytes / statistics.median(cold_s) / 1e6
            local, by_url = statistics.median(local_s), statistics.median(url_s)
            added = by_url - local
            print(f"{size_mb:>5} MiB {raw_bw:>9.1f} {ranged_bw:>12.1f} {cold_bw:>10.1f} {cold_bw / raw_bw:>9.2f} "
                  f"{cold_bw / ranged_bw:>12.2f} "
                  f"{local * 1e3:>8.1f} ms {by_url * 1e3:>6.1f} ms {added * 1e3:>6.1f} ms {growth:>9.1f} MB",
                  flush=True)  # fmt: skip
            record(f"{name} {size_mb} MiB", key=f"{name}_size{size_mb}", raw_mb_s=raw_bw, ranged_mb_s=ranged_bw, cold_mb_s=cold_bw,
                   cold_over_raw=cold_bw / raw_bw, cold_over_ranged=cold_bw / ranged_bw, local_load_s=local, url_load_s=by_url, added_s=added,
                   peak_growth_mb=growth)  # fmt: skip
            verdict(f"{name} {size_mb} MiB cold >= 0.8 of raw", cold_bw / raw_bw >= 0.8, f"{cold_bw / raw_bw:.2f}",
                    key=f"{name}_cold{size_mb}")  # fmt: skip
            verdict(f"{name} {size_mb} MiB cold >= 0.8 of ranged", cold_bw / ranged_bw >= 0.8,
                    f"{cold_bw / ranged_bw:.2f}", key=f"{name}_cold_ranged{size_mb}")  # fmt: skip
            verdict(f"{name} {size_mb} MiB warm adds <= 10 ms", added <= 0.010, f"{added * 1e3:.1f} ms",
                    key=f"{name}_warm{size_mb}")  # fmt: skip
            verdict(f"{name} {size_mb} MiB peak memory growth <= {slack_mb:.0f} MB", growth <= slack_mb,
                    f"{growth:.1f} MB", key=f"{name}_memory{size_mb}")  # fmt: skip
            client.delete_object(Bucket="models", Key=key)
            zpath.unlink()
            _clear(Path(os.environ["NEUROPOD_CACHE_DIR"]))
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()

