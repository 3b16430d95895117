"""``create_torch_export_neuropod`` and ``create_aoti_neuropod``: package a PyTorch 2 model with its problem spec.

The spec is the one description of the model's dynamic shapes: each symbol
in it becomes one ``torch.export.Dim``, shared by every input dimension that
names it; a fixed size stays static; ``None`` is ``Dim.AUTO`` (dynamic when
the model allows it). A symbol the model cannot keep dynamic (it works for one
size only) fails the packaging, naming the symbol and torch's reason.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import itertools
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neuropod.create import create_package, package_options
from neuropod.errors import PackageError, SpecError
from neuropod.plugins import import_framework
from neuropod.spec import TensorSpec, parse_spec
from neuropod.strings import refuse_dtypes
from neuropod_torch._archive import aoti_metadata, check_archive
from neuropod_torch._hooks import AOTI, FRAMEWORK_DISTRIBUTIONS, TORCH_EXPORT

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from neuropod.create import PackageOptions

MODEL_PATH = "0/data/model.pt2"
#: The loggers that narrate a failed export on stderr (the error raised says it better).
_NOISY_LOGGERS = ("torch._guards", "torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch._export", "torch.export")


def create_torch_export_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    module: Any = None,
    exported_program: Any = None,
    example_inputs: Mapping[str, Any] | None = None,
    strict: bool = False,
    **options: Unpack[PackageOptions],
) -> Path:
    """Package a PyTorch model as a ``torch.export`` program (platform ``torch_export``).

    :param neuropod_path: where to write the package (must not exist).
    :param model_name: the model's name.
    :param input_spec: list of ``{"name", "dtype", "shape"}``: one entry per
        tensor argument of ``forward``, by name. Symbols become shared
        ``torch.export.Dim``s, ``None`` dims ``Dim.AUTO``, numbers stay static.
    :param output_spec: the same, for what ``forward`` returns (a dict of
        name -> tensor, one tensor, a named tuple, a tuple of dicts, or a
        tuple of tensors in output-spec order).
    :param module: a ``torch.nn.Module`` to export (in eval mode; its mode is
        restored afterwards) with ``torch.export.export``.
    :param exported_program: or an ``ExportedProgram`` you exported; exactly one of the two.
    :param example_inputs: input name to array or tensor, the sizes export
        traces with; default ``test_input_data``. Give each symbol a size of at
        least 2: torch specializes sizes 0 and 1.
    :param strict: ``torch.export.export``'s ``strict`` (False: trace with
        Python, True: with TorchDynamo).
    :param options: the common keywords (:class:`neuropod.package.PackageOptions`):
        ``platform_version_semver`` (default ``^<this torch>``: torch reads a
        program of the same schema major version), ``custom_ops`` (loaded with
        ``torch.ops.load_library`` before the program), ``test_input_data``, ...
    :returns: the path written.
    :raises PackageError: the model does not export, a spec symbol was
        specialized, or the package does not load and reproduce its test data.
    """
    packager = "create_torch_export_neuropod"
    import_framework("torch", TORCH_EXPORT, packager)
    import torch
    opts = package_options(packager, options)
    inputs = parse_spec(input_spec, "input_spec")
    refuse_dtypes(model_name, inputs, parse_spec(output_spec, "output_spec"), {"bytes"}, TORCH_EXPORT)
    program = _program(packager, model_name, inputs, module, exported_program, example_inputs, strict, opts, "cpu")
    args = _positional_names(program)
    with tempfile.TemporaryDirectory(prefix="neuropod-torch-") as tmp:
        saved = Path(tmp) / "model.pt2"
        try:
            torch.export.save(program, saved)
        except Exception as e:
            raise _save_error(packager, model_name, "torch.export.save", e) from e
        return create_package(
            packager, neuropod_path, model_name, TORCH_EXPORT, input_spec, output_spec, {MODEL_PATH: saved}, options,
            backend_config={"args": args}, framework_distributions=FRAMEWORK_DISTRIBUTIONS,
            exported_with={"torch": torch.__version__, "export_schema": _schema_version()},
            default_version_range=f"^{_release(torch.__version__)}",
        )  # fmt: skip


def create_aoti_neuropod(
    neuropod_path: str | os.PathLike[str],
    model_name: str,
    input_spec: Sequence[Mapping[str, Any]],
    output_spec: Sequence[Mapping[str, Any]],
    module: Any = None,
    exported_program: Any = None,
    example_inputs: Mapping[str, Any] | None = None,
    strict: bool = False,
    device: str = "cpu",
    inductor_configs: Mapping[str, Any] | None = None,
    compiled_package: str | os.PathLike[str] | None = None,
    **options: Unpack[PackageOptions],
) -> Path:
    """Package a PyTorch model compiled by AOTInductor (platform ``aoti``).

    The model is exported as :func:`create_torch_export_neuropod` does, then
    compiled with ``torch._inductor.aoti_compile_and_package`` (it needs a
    C++ compiler, and takes from seconds to minutes). The package runs only
    on the torch release that compiled it and on the kind of device it was
    compiled for: its ``platform_version_semver`` defaults to that release
    (``==2.13.0``), and ``device_requirements`` records the device (and, on
    the CPU, the instruction set inductor compiled for).

    :param module: a ``torch.nn.Module`` to export and compile.
    :param exported_program: or an ``ExportedProgram`` to compile.
    :param compiled_package: or the ``.pt2`` that ``aoti_compile_and_package``
        wrote, with the torch installed here; exactly one of the three.
    :param example_inputs: as for :func:`create_torch_export_neuropod`.
    :param strict: as for :func:`create_torch_export_neuropod`.
    :param device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``): where the compiled
        model runs; compiling for CUDA needs a CUDA build of torch and a GPU.
    :param inductor_configs: passed to ``aoti_compile_and_package``. Inductor
        compiles CPU code for this machine's CPU; ``{"cpp.simdlen": 256,
        "cpp.march": "x86-64-v3"}`` makes a package every AVX2 CPU can run.
    :param options: the common keywords (:class:`neuropod.package.PackageOptions`);
        ``default_input_tensor_device`` defaults to ``"CPU"`` for a CPU package.
    :returns: the path written.
    :raises PackageError: the model does not export or compile, or the
        package does not load and reproduce its test data.
    """
    packager = "create_aoti_neuropod"
    import_framework("torch", AOTI, packager)
    import torch
    if sum(x is not None for x in (module, exported_program, compiled_package)) != 1:
        raise PackageError(f"{packager} needs exactly one of module=, exported_program= or compiled_package=")
    kind = _device_kind(packager, device)
    if kind == "cuda" and compiled_package is None and not torch.cuda.is_available():
        raise PackageError(
            f"{packager}: compiling {model_name!r} for CUDA needs a CUDA build of torch and a GPU, and torch "
            f"{torch.__version__} {'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}; compile "
            "on a GPU machine, or use device='cpu'"
        )
    defaults = {"default_input_tensor_device": "CPU" if kind == "cpu" else "GPU"}
    opts = package_options(packager, options, defaults)
    inputs = parse_spec(input_spec, "input_spec")
    refuse_dtypes(model_name, inputs, parse_spec(output_spec, "output_spec"), {"bytes"}, AOTI)
    with tempfile.TemporaryDirectory(prefix="neuropod-aoti-") as tmp:
        if compiled_package is not None:
            compiled = Path(compiled_package)
            if not compiled.is_file():
                raise PackageError(f"{packager}: compiled_package {compiled} does not exist")
            args = None
        else:
            program = _program(packager, model_name, inputs, module, exported_program, example_inputs, strict, opts, device)
            args = _positional_names(program)
            compiled = _compile(packager, model_name, program, Path(tmp) / "model.pt2", kind, inductor_configs)
        where = f"{packager} for model {model_name!r}"
        check_archive(compiled, AOTI, where, torch)
        metadata = aoti_metadata(compiled, where)
        compiled_for = metadata.get("AOTI_DEVICE_KEY", kind)
        if compiled_package is not None and compiled_for != kind:
            raise PackageError(
                f"{where}: compiled_package was compiled for {compiled_for}, but device={device!r} was given"
            )
        requirements: dict[str, Any] = {"device": compiled_for}
        if compiled_for == "cpu":
            requirements.update(cpu_isa=metadata.get("AOTI_CPU_ISA", ""), machine=metadata.get("AOTI_MACHINE", ""))
        elif metadata.get("AOTI_COMPUTE_CAPABILITY"):
            requirements["compute_capability"] = _cc(metadata["AOTI_COMPUTE_CAPABILITY"])
        return create_package(
            packager, neuropod_path, model_name, AOTI, input_spec, output_spec, {MODEL_PATH: compiled}, options,
            backend_config={"args": args} if args is not None else None,
            framework_distributions=FRAMEWORK_DISTRIBUTIONS,
            exported_with={"torch": torch.__version__, "aoti": {k: v for k, v in metadata.items() if k.startswith("AOTI_")}},
            device_requirements=requirements, default_version_range=f"=={_release(torch.__version__)}",
            defaults=defaults,
        )  # fmt: skip


# --- export -------------------------------------------------------------------------------------------


def _program(
    packager: str, model_name: str, inputs: Sequence[TensorSpec], module: Any, exported_program: Any,
    example_inputs: Mapping[str, Any] | None, strict: bool, opts: Mapping[str, Any], device: str,
) -> Any:  # fmt: skip
    """The ExportedProgram to package: the one given (checked against the spec), or ``module`` exported."""
    import torch

    if (module is None) == (exported_program is None):
        raise PackageError(f"{packager} needs exactly one of module= or exported_program=")
    strings = [s.name for s in inputs if s.dtype == "string"]
    if strings:
        raise SpecError(
            f"{packager}: input(s) {', '.join(map(repr, strings))} are string tensors, but torch.export programs "
            "take tensors only; package a model with strings as TorchScript, or as a python package"
        )
    if exported_program is not None:
        if not isinstance(exported_program, torch.export.ExportedProgram):
            raise PackageError(f"exported_program must be a torch.export.ExportedProgram, not {type(exported_program).__name__}")
        _check_program_against_spec(packager, model_name, exported_program, inputs)
        if _device_kind(packager, device) == "cuda":
            from torch.export.passes import move_to_device_pass

            exported_program = move_to_device_pass(exported_program, torch.device(device))
        return exported_program
    if isinstance(module, torch.jit.ScriptModule):
        raise PackageError(
            f"{packager}: module is a TorchScript module, which torch.export cannot export; pass the original "
            "torch.nn.Module, or package it with create_torchscript_neuropod"
        )
    if not isinstance(module, torch.nn.Module):
        raise PackageError(f"module must be a torch.nn.Module, not {type(module).__name__}")
    args, kwargs = _arguments(packager, module, inputs)
    examples = example_inputs if example_inputs is not None else opts.get("test_input_data")
    if examples is None:
        raise PackageError(
            f"{packager}: exporting {model_name!r} needs example inputs to trace with: pass example_inputs= or "
            "test_input_data= (a dict of input name to array)"
        )
    target = torch.device(device) if _device_kind(packager, device) == "cuda" else torch.device("cpu")
    on_cpu = {n for n, d in (opts.get("input_tensor_device") or {}).items() if str(d).upper() == "CPU"}
    tensors = _example_tensors(packager, inputs, examples, target, on_cpu)
    dims, shapes = _dynamic_shapes(inputs)
    was_training = module.training
    placed = next(itertools.chain(module.parameters(), module.buffers()), None)
    was_on = placed.device if placed is not None else None
    module.eval()
    try:
        if target.type != "cpu":
            module.to(target)  # moved back below: the caller's module is left as it was
        with _quiet_export(), _without_partial_graph():
            program = torch.export.export(
                module, tuple(tensors[n] for n in args), {n: tensors[n] for n in kwargs} or None,
                dynamic_shapes=shapes, strict=strict,
            )  # fmt: skip
    except Exception as e:
        raise _export_error(packager, model_name, e, dims, tensors, inputs, strict) from e
    finally:
        module.train(was_training)
        if was_on is not None and target.type != "cpu":
            module.to(was_on)
    if target.type != "cpu" and was_on is not None and was_on != target:
        # The program holds the module's own parameters, and moving the module back moved them too, under a
        # graph traced on the GPU: the program's copy goes back to the GPU, the caller's module stays put.
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, target)
    return program


def _device_kind(packager: str, device: str) -> str:
    if device == "cpu":
        return "cpu"
    if isinstance(device, str) and re.fullmatch(r"cuda(:[0-9]+)?", device):
        return "cuda"
    raise PackageError(f"{packager}: device must be 'cpu' or 'cuda' (or 'cuda:N'), not {device!r}")


def _arguments(packager: str, module: Any, inputs: Sequence[TensorSpec]) -> tuple[list[str], list[str]]:
    """The spec's inputs as (positional, keyword) arguments of ``module.forward``, by name."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError) as e:
        raise PackageError(f"{packager}: cannot read the signature of {type(module).__name__}.forward ({e})") from None
    spec_names = [s.name for s in inputs]
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params)
    unknown = [n for n in spec_names if n not in {p.name for p in named}] if not takes_any else []
    required = [p.name for p in named if p.default is p.empty and p.name not in spec_names]
    if unknown or required:
        problems = []
        if unknown:
            problems.append(f"the input spec has {', '.join(map(repr, unknown))} that it does not take")
            odd = [n for n in unknown if not n.isidentifier()]
            if odd:
                problems.append(
                    f"{', '.join(map(repr, odd))} cannot be a parameter name of forward() for {packager} "
                    "(torch.export passes each input as the parameter of its name, and parameter names are "
                    "identifiers: no '/', ':' or '.'); rename the input in the spec"
                )
        if required:
            problems.append(f"it needs {', '.join(map(repr, required))} that the input spec does not describe")
        shown = ", ".join(p.name for p in params)
        raise SpecError(
            f"{packager}: {type(module).__name__}.forward({shown}) does not match the input spec "
            f"({'; '.join(problems)}). Neuropod passes one tensor per input name"
        )
    args: list[str] = []
    for p in named:
        if p.name not in spec_names or p.kind == p.KEYWORD_ONLY:
            break  # a parameter left at its default: those after it go by keyword
        args.append(p.name)
    return args, [n for n in spec_names if n not in args]


def _example_tensors(
    packager: str, inputs: Sequence[TensorSpec], examples: Mapping[str, Any], device: Any, on_cpu: set[str]
) -> dict[str, Any]:
    import numpy as np
    import torch

    missing = [s.name for s in inputs if s.name not in examples]
    if missing:
        raise PackageError(f"{packager}: the example inputs have no {', '.join(map(repr, missing))}")
    out = {}
    for s in inputs:
        value = examples[s.name]
        tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(np.asarray(value)))
        out[s.name] = tensor.to(torch.device("cpu") if s.name in on_cpu else device)
    return out


def _dynamic_shapes(inputs: Sequence[TensorSpec]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(spec symbol -> its Dim, ``dynamic_shapes`` by argument name): one Dim per symbol, shared."""
    from torch.export import Dim

    dims: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    for s in inputs:
        entry: dict[int, Any] = {}
        for i, d in enumerate(s.shape):
            if d is None:
                entry[i] = Dim.AUTO
            elif isinstance(d, str):
                if d not in dims:
                    dims[d] = Dim(d if d.isidentifier() else "sym_" + re.sub(r"\W", "_", d))
                entry[i] = dims[d]
        shapes[s.name] = entry or None
    return dims, shapes


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Keep torch's log lines about a failing export off stderr (the PackageError says it), and its
    deprecation notices about its own internals."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.|copyreg")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _without_partial_graph() -> Iterator[None]:
    """torch.export prints the graph it had traced so far to stderr when it fails (its
    ``partial_fx_graph``); our error names the failing line instead, so that print is dropped
    and anything else written to stderr meanwhile is passed on."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            yield
    except BaseException as e:
        partial = getattr(e, "partial_fx_graph", None)
        text = captured.getvalue()
        if partial is not None:
            text = text.replace(f"{partial}\n", "")  # printed once per level of its wrappers
        sys.stderr.write(text)
        raise
    else:
        sys.stderr.write(captured.getvalue())


_VIOLATED = re.compile(r"Constraints violated \(([^)]*)\)")
_SPECIALIZED = re.compile(r"You marked (\w+) as dynamic but your code specialized it to be a constant \((\d+)\)")


def _export_error(
    packager: str, model_name: str, e: BaseException, dims: Mapping[str, Any], tensors: Mapping[str, Any],
    inputs: Sequence[TensorSpec], strict: bool,
) -> PackageError:  # fmt: skip
    text = str(e)
    violated = _VIOLATED.search(text)
    if violated:
        by_dim = {getattr(dim, "__name__", sym): sym for sym, dim in dims.items()}
        symbols = [by_dim.get(n.strip(), n.strip()) for n in violated.group(1).split(",") if n.strip()]
        reasons = [line.strip(" -").split(". ")[0] for line in text.splitlines() if line.strip().startswith("- ")]
        reason = "; ".join(dict.fromkeys(reasons))
        hints: list[str] = []
        for m in _SPECIALIZED.finditer(text):
            sym, size = by_dim.get(m.group(1), m.group(1)), int(m.group(2))
            if size <= 1 and size in _example_sizes(sym, inputs, tensors):
                hints.append(
                    f"the example inputs give {sym!r} the size {size}, and torch specializes sizes 0 and 1: pass "
                    f"example_inputs= with a size of 2 or more for {sym!r}"
                )
        hint = "; ".join(dict.fromkeys(hints)) or (
            "the model works for that size only: make it size-generic, or write the fixed size in the spec instead "
            "of the symbol"
        )
        where = _user_frame(text)
        return PackageError(
            f"{packager}: exporting {model_name!r} specialized the spec symbol(s) {', '.join(map(repr, symbols))}: "
            f"{reason or _first_line(text)}{f' ({where})' if where else ''}. {hint[0].upper() + hint[1:]}."
        )
    where = _user_frame(text)
    if strict:
        advice = "try strict=False (trace with Python instead of TorchDynamo)"
    else:
        advice = "try strict=True (TorchDynamo)"
    return PackageError(
        f"{packager}: torch.export could not export {model_name!r} (strict={strict}): {type(e).__name__}: "
        f"{_first_line(text)}{f'; at {where}' if where else ''}. Rewrite that construct (torch.cond for a branch on "
        f"tensor values), {advice}, or package the model as TorchScript (create_torchscript_neuropod)"
    )


def _example_sizes(symbol: str, inputs: Sequence[TensorSpec], tensors: Mapping[str, Any]) -> set[int]:
    return {
        int(tensors[s.name].shape[i]) for s in inputs for i, d in enumerate(s.shape)
        if d == symbol and s.name in tensors and i < tensors[s.name].dim()
    }  # fmt: skip


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)(?:, code: (.*))?')


def _user_frame(text: str) -> str:
    """The model's own line that torch's message points at: ``file:line in fn: code``."""
    lines = text.splitlines()
    found = ""
    for i, line in enumerate(lines):
        m = _FRAME.search(line)
        if not m or f"{os.sep}torch{os.sep}" in m.group(1):
            continue
        code = m.group(4) or (lines[i + 1].strip() if i + 1 < len(lines) else "")
        found = f"{Path(m.group(1)).name}:{m.group(2)} in {m.group(3)}" + (f": {code.strip()}" if code.strip() else "")
    return found


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:500]
    return "(no message)"


def _check_program_against_spec(packager: str, model_name: str, program: Any, inputs: Sequence[TensorSpec]) -> None:
    """A given program must take the spec's inputs, and keep dynamic what the spec says is."""
    placeholders = {
        node.name: node for node in program.graph.nodes
        if node.op == "placeholder" and node.name in set(program.graph_signature.user_inputs)
    }  # fmt: skip
    for s in inputs:
        node = placeholders.get(s.name)
        if node is None:
            continue  # names are checked when the package loads, with the program's call spec
        value = node.meta.get("val")
        shape = getattr(value, "shape", None)
        if shape is None:
            continue
        if len(shape) != len(s.shape):
            raise SpecError(
                f"{packager}: input {s.name!r} of {model_name!r} is {len(shape)}-D in the program, "
                f"{len(s.shape)}-D in the spec ({s.describe_shape()})"
            )
        for i, (dim, want) in enumerate(zip(shape, s.shape)):
            static = isinstance(dim, int)
            if want is not None and not isinstance(want, str) and static and dim != want:
                raise SpecError(
                    f"{packager}: dim {i} of input {s.name!r} is {dim} in the program, {want} in the spec"
                )
            if isinstance(want, str) and static:
                raise PackageError(
                    f"{packager}: dim {i} of input {s.name!r} is fixed at {dim} in the exported program, but the "
                    f"spec says symbol {want!r}: export it with dynamic_shapes for that dim, or pass module= and "
                    "let neuropod export it from the spec"
                )


def _positional_names(program: Any) -> list[str]:
    """The names of the program's positional inputs, in order (what its forward calls them)."""
    # lazy: torch (the runtime imports it), kept out of `import neuropod_torch.packager`
    from neuropod_torch._runtime import tree_children

    n = tree_children(program.call_spec.in_spec)[0].num_children
    try:
        params = list(inspect.signature(program.module().forward).parameters)
    except (TypeError, ValueError):
        params = list(program.graph_signature.user_inputs)
    return params[:n]


def _compile(
    packager: str, model_name: str, program: Any, dest: Path, kind: str, inductor_configs: Mapping[str, Any] | None
) -> Path:
    import torch

    print(
        f"{packager}: compiling {model_name!r} with AOTInductor for {kind} (torch {torch.__version__}); "
        "this takes from seconds to minutes ...", file=sys.stderr, flush=True,
    )  # fmt: skip
    start = time.perf_counter()
    try:
        with _quiet_export():
            out = torch._inductor.aoti_compile_and_package(
                program, package_path=str(dest), inductor_configs=dict(inductor_configs or {})
            )
    except Exception as e:
        if _NAMED_TUPLE.search(str(e)):
            raise _save_error(packager, model_name, "AOTInductor", e) from e
        text = str(e)
        hint = " (AOTInductor needs a C++ compiler: install g++)" if "g++" in text or "compiler" in text.lower() else ""
        raise PackageError(
            f"{packager}: AOTInductor could not compile {model_name!r}{hint}: {type(e).__name__}: {_first_line(text)}"
        ) from e
    print(f"{packager}: compiled {model_name!r} in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return Path(out)


_NAMED_TUPLE = re.compile(r"TreeSpec of namedtuple class <class '([^']+)'>")


def _save_error(packager: str, model_name: str, what: str, e: BaseException) -> PackageError:
    m = _NAMED_TUPLE.search(str(e))
    if m:
        return PackageError(
            f"{packager}: {model_name!r} returns a named tuple ({m.group(1)}), which {what} can store only with the "
            "class registered (torch.utils._pytree) in every process that loads it; return a dict of name -> "
            "tensor instead"
        )
    return PackageError(f"{packager}: {what} could not write {model_name!r}: {type(e).__name__}: {_first_line(str(e))}")


def _release(version: str) -> str:
    from packaging.version import Version

    return Version(version).public


def _schema_version() -> str:
    try:
        from torch._export.serde.schema import SCHEMA_VERSION

        return ".".join(map(str, SCHEMA_VERSION))
    except ImportError:
        return ""


def _cc(value: str) -> str:
    """Inductor's compute capability ``"90"`` as ``"9.0"``."""
    return value if "." in value or len(value) < 2 else f"{value[:-1]}.{value[-1]}"


__all__ = ["create_aoti_neuropod", "create_torch_export_neuropod"]
