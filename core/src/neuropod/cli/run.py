"""``neuropod test`` and ``neuropod infer``: run a package on its bundled test data, or on inputs from .npy files."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, TextIO

from neuropod.cli.inspect import remote_options
from neuropod.cli.output import EXIT_TEST_FAILED, describe_os_error, fmt_array, one_line, safe, short, show
from neuropod.errors import NeuropodError
from neuropod.remote import is_remote


def cmd_test(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.testdata import run_test_data  # lazy: numpy, kept out of `neuropod --help`

    if is_remote(args.package):
        raise NeuropodError(
            f"{short(args.package)} is a remote model; `neuropod test` runs the test data bundled in a package "
            "file or directory, which a server does not send. Test the package where it is served "
            "(neuropod test PKG), or run the remote model on your inputs: neuropod infer URL --input NAME=FILE.npy"
        )
    report = run_test_data(
        args.package, trust_pickle=args.trust_pickle, device=args.device, backend=args.backend,
        rtol=args.rtol, atol=args.atol,
    )
    print(f"Model {report.model!r} with {safe(report.backend)} on {report.device}", file=out)
    for name, arr in report.inputs.items():
        print(f"  input  {safe(name)}: {fmt_array(arr)}", file=out)
    for name, arr in report.outputs.items():
        print(f"  output {safe(name)}: {fmt_array(arr)}", file=out)
    if report.expected is None:
        print("No expected outputs are bundled: the model ran, nothing was compared.", file=out)
        return 0
    if report.passed:
        print(f"PASSED: {len(report.expected)} output(s) match the expected values", file=out)
        return 0
    print("FAILED:", file=out)
    for m in report.mismatches:
        print(f"  {safe(m)}", file=out)
    return EXIT_TEST_FAILED


def _load_input(spec: str) -> tuple[str, Any]:
    import numpy as np

    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise NeuropodError(f"--input '{short(spec)}' must be NAME=FILE.npy")
    where = f"--input {short(name)}: {short(path)}"
    try:
        # allow_pickle=False also keeps numpy's bound on the header size (a huge header is a ValueError).
        arr = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise NeuropodError(f"--input {short(name)}: no such file {short(path)}") from None
    except OSError as e:
        raise NeuropodError(f"{where} cannot be read: {describe_os_error(e)}") from None
    except EOFError:  # an empty file, or /dev/null
        raise NeuropodError(f"{where} is empty; expected a .npy file (numpy.save)") from None
    except MemoryError as e:  # a header that claims an array larger than memory
        raise NeuropodError(f"{where} is too large to load: {one_line(str(e))}") from None
    except ValueError as e:
        raise NeuropodError(f"{where} is not a readable .npy file without pickles: {one_line(str(e))}") from None
    if not isinstance(arr, np.ndarray):  # np.load opens a .npz as an archive of arrays
        arr.close()
        raise NeuropodError(f"{where} is a .npz archive; give one .npy file per input (NAME=FILE.npy)")
    return name, arr


def _output_dir(path: str) -> Path:
    """Make ``--output-dir`` (before the model is loaded, so a bad one fails fast)."""
    out_dir = Path(path)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise NeuropodError(f"--output-dir '{short(path)}' exists and is not a directory") from None
    except OSError as e:
        raise NeuropodError(f"--output-dir '{short(path)}' cannot be created: {describe_os_error(e)}") from None
    return out_dir.resolve()


def output_file_name(name: str) -> str:
    """The file ``neuropod infer --output-dir`` writes output ``name`` to: ``NAME.npy``, with
    ``%``, ``/`` and ``\\`` written as ``%25``, ``%2F`` and ``%5C`` (tensor names may hold
    them: ``InceptionV3/Predictions/Softmax:0`` is ``InceptionV3%2FPredictions%2FSoftmax:0.npy``)."""
    return name.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C") + ".npy"


def _output_file(out_dir: Path, name: str, model: str) -> Path:
    """Where output ``name`` is written: a file directly in ``out_dir``, whatever the name."""
    from neuropod.spec import NAME_RULE, tensor_name_problem  # lazy: numpy, kept out of `neuropod --help`

    problem = tensor_name_problem(name)
    target = out_dir / output_file_name(name)
    if problem is None and len(target.name.encode("utf-8")) > 255:
        problem = f"its file name {short(target.name)} is longer than the 255 bytes a file name may be"
    if problem is None and target.resolve().parent != out_dir:  # e.g. an existing link out of the directory
        problem = f"{short(target)} leads out of the directory"
    if problem is not None:
        raise NeuropodError(
            f"Output {show(name)} of model {show(model)} cannot be written to --output-dir "
            f"'{short(out_dir)}': {problem}; {NAME_RULE}"
        )
    return target


def cmd_infer(args: argparse.Namespace, out: TextIO) -> int:
    from neuropod.loader import load_neuropod  # lazy: numpy, kept out of `neuropod --help`

    inputs = dict(_load_input(s) for s in args.input)
    out_dir = _output_dir(args.output_dir) if args.output_dir else None
    with load_neuropod(args.package, device=args.device, backend=args.backend, **remote_options(args)) as model:
        if getattr(args, "stream", False) or getattr(model, "decoupled", False):
            return _infer_stream(model, inputs, args.output or None, out_dir, out)
        if getattr(model, "stateful", False):  # one step of a new sequence, from the initial state
            with model.sequence() as sequence:
                outputs = sequence.infer(inputs, requested_outputs=args.output or None, end=True)
        else:
            outputs = model.infer(inputs, requested_outputs=args.output or None)
        print(_model_line(model), file=out)
        if getattr(model, "stateful", False):
            print("  (stateful: one step of a new sequence, from the initial state)", file=out)
        if out_dir is not None:
            # Every path is checked before the first file is written.
            targets = {name: _output_file(out_dir, name, model.name) for name in outputs}
    if out_dir is None:
        for name, arr in outputs.items():
            print(f"  {safe(name)}: {fmt_array(arr)}", file=out)
        return 0
    _save(outputs, targets, out)
    return 0


def _model_line(model: Any) -> str:
    """``Model 'name' with BACKEND on DEVICE`` (and where a remote model runs)."""
    where = model.backend.location if model.backend.location.startswith("remote") else ""
    return f"Model {model.name!r} with {safe(model.backend.id)} on {model.device}" + (f" ({safe(where)})" if where else "")


def _save(outputs: dict[str, Any], targets: dict[str, Path], out: TextIO) -> None:
    """Write each output to its checked path (``.npy``; string outputs as numpy unicode)."""
    import numpy as np  # lazy: kept out of `neuropod --help`

    for name, arr in outputs.items():
        if arr.dtype.kind == "O":
            arr = np.asarray(arr.tolist(), dtype=str)
        try:
            np.save(targets[name], arr, allow_pickle=False)
        except OSError as e:
            raise NeuropodError(f"Cannot write output {show(name)}: {describe_os_error(e)}") from None
        print(f"  wrote {safe(targets[name])}: {fmt_array(arr)}", file=out)


def _infer_stream(model: Any, inputs: dict[str, Any], requested: list[str] | None, out_dir: Path | None,
                  out: TextIO) -> int:  # fmt: skip
    """``neuropod infer --stream``: each response printed (or written to ``DIR/N/``) as it
    arrives, flushed, then how many came. An error after some responses is raised after them."""
    print(f"{_model_line(model)}: responses as they arrive", file=out)
    out.flush()
    count = 0
    with model.infer_stream(inputs, requested) as responses:
        for outputs in responses:
            count += 1
            print(f"response {count}:", file=out)
            if out_dir is None:
                for name, arr in outputs.items():
                    print(f"  {safe(name)}: {fmt_array(arr)}", file=out)
            else:
                folder = _output_dir(str(out_dir / str(count)))
                _save(outputs, {name: _output_file(folder, name, model.name) for name in outputs}, out)
            out.flush()
    print(f"{count} response{'' if count == 1 else 's'}", file=out)
    return 0
