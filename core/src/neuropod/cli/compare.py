"""``neuropod compare``: one problem's implementations side by side (agreement, speed, memory)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from neuropod.cli.inspect import read_token
from neuropod.cli.output import safe
from neuropod.errors import NeuropodError

HELP = "compare packages and served models that solve one problem: agreement, speed, memory"


def add_compare(sub: Any) -> None:
    s = sub.add_parser("compare", help=HELP, description=HELP + ". The first candidate is the baseline.")
    s.add_argument("candidates", nargs="+", metavar="CANDIDATE",
                   help="[LABEL=]PACKAGE[@PIN]... or a served model's URL: a package path or URL, pinned with "
                   "@onnx==1.20.1 (a backend or a backend environment's version), @cpu / @cuda:0, @ope")
    s.add_argument("--map", action="append", default=[], metavar="CAND.TENSOR=TENSOR",
                   help="a candidate's tensor is the baseline's TENSOR (e.g. 2.logits=out)")
    g = s.add_argument_group("inputs (default: the baseline's bundled test data)")
    g.add_argument("--inputs", action="append", default=[], metavar="FILE.npz",
                   help="an input set (numpy.savez of every input)")
    g.add_argument("--generate", type=int, metavar="N", help="N input sets generated from the baseline's spec")
    g.add_argument("--dims", action="append", default=[], metavar="SYMBOL=SIZE",
                   help="a symbol's size in generated inputs (others: 2), e.g. batch_size=8")
    g.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    g.add_argument("--trust-pickle", action="store_true", help="allow reading an old test_data.pkl (runs code!)")
    g = s.add_argument_group("agreement")
    g.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance for floats (default 1e-4)")
    g.add_argument("--atol", type=float, default=1e-5, help="absolute tolerance for floats (default 1e-5)")
    g = s.add_argument_group("speed")
    g.add_argument("--no-speed", action="store_true", help="check agreement only, measure nothing")
    g.add_argument("--warmup", type=int, default=10, help="calls before timing (default 10)")
    g.add_argument("--duration", type=float, default=2.0,
                   help="seconds per measurement, at least 20 calls (default 2)")
    g.add_argument("--batch-sizes", default="1,8,32", metavar="N,N,...",
                   help="throughput at these batch sizes when the inputs share a batch symbol (default 1,8,32; "
                   "'' for none)")
    g.add_argument("--rate", type=float, metavar="R", help="also latency with calls arriving at R per second")
    g.add_argument("--max-slowdown", type=float, metavar="X",
                   help="fail (exit 1) when a candidate's p50 latency is more than X times the baseline's")
    g = s.add_argument_group("running")
    g.add_argument("--use-ope", action="store_true", help="run every package candidate in a worker process")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds each candidate may take in all (default 600)")
    s.add_argument("--auth-token-file", metavar="FILE", help="for served candidates: the bearer token on this file's "
                   "first line")  # fmt: skip
    g = s.add_argument_group("output")
    g.add_argument("--json", metavar="FILE", help="write every figure, the machine and the versions as JSON")
    g.add_argument("--html", metavar="FILE", help="write a self-contained HTML report with charts")
    g.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")
    s.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace, out: TextIO) -> int:
    # lazy: numpy (and the comparison's modules), kept out of `neuropod --help`
    from neuropod.comparison import compare, render_table, write_html, write_json
    from neuropod.comparison.inputs import parse_batch_sizes  # lazy: as above
    from neuropod.comparison.runner import command_line  # lazy: as above

    if args.generate is not None and args.generate < 1:
        raise NeuropodError("--generate N must be at least 1")
    if args.inputs and (args.generate is not None or args.dims):
        given = "--generate" if args.generate is not None else "--dims"
        raise NeuropodError(f"--inputs and {given} both say what to run on: give the input files, or {given} to "
                            "generate inputs, not both")  # fmt: skip
    err = sys.stderr

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"neuropod compare: {safe(line)}", file=err, flush=True)

    for path in (args.json, args.html):
        if path is not None:
            _check_writable(path)
    result = compare(
        args.candidates, inputs=args.inputs or None, generate_sets=args.generate, dims=args.dims, seed=args.seed,
        maps=args.map, rtol=args.rtol, atol=args.atol, speed=not args.no_speed, warmup=args.warmup,
        duration=args.duration, batch_sizes=parse_batch_sizes(args.batch_sizes), rate=args.rate,
        max_slowdown=args.max_slowdown, use_ope=args.use_ope, timeout=args.timeout,
        remote_options={"auth_token": read_token(args.auth_token_file)} if args.auth_token_file else None, trust_pickle=args.trust_pickle, progress=progress,
        command=command_line(getattr(args, "argv", None) or sys.argv[1:]),
    )  # fmt: skip
    print(safe(render_table(result), keep="\n"), file=out)
    if args.json:
        print(f"wrote {safe(str(write_json(result, args.json)))}", file=out)
    if args.html:
        print(f"wrote {safe(str(write_html(result, args.html)))}", file=out)
    return result.exit_code


def _check_writable(path: str) -> None:
    """A report path that cannot be written fails before minutes of measuring, not after."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise NeuropodError(f"Cannot write {path}: no such directory {folder}")
    if os.path.isdir(path):
        raise NeuropodError(f"Cannot write {path}: it is a directory")

