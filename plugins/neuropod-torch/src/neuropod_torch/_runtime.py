"""The loaded program behind a model (imports torch).

Both platforms call the program with one tensor per input, in the order its
``forward`` takes them: positional arguments first, then keyword arguments
(``0/config.json`` records which names are which; a program that has no such
record is read from its own call spec). What ``forward`` returns is mapped to
the output spec's names once, at load time, from the program's output
structure, as the TorchScript backend reads a returned value:

* a dict: its keys are the names;
* a single tensor: the output spec's only entry;
* a named tuple: its field names;
* a tuple (or list) of dicts: the dicts' keys (a name in two of them is an error);
* a tuple (or list) of tensors: the output spec's names, in order.

Each call then only converts the inputs, calls, and picks the outputs out of
the result by precomputed keys.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from neuropod.errors import BackendError, NeuropodError, PackageError, SpecError
from neuropod.package import Package
from neuropod.probe import load_torch_libraries
from neuropod.spec import TensorSpec
from neuropod.torch_support import THREAD_OPTIONS, check_device, check_load_options, gpu_model_input, release_gpu_memory
from neuropod_torch._archive import aoti_metadata, check_archive, program_ops

MODEL_FILE = "model.pt2"
_CPU = torch.device("cpu")

#: Load options both backends accept: torch's thread counts, both process-wide.
LOAD_OPTIONS = THREAD_OPTIONS
#: And the AOTInductor backend's own.
AOTI_LOAD_OPTIONS = {
    **LOAD_OPTIONS,
    "num_runners": "copies of the compiled model that can run at once (default 1: calls from several threads "
    "take turns)",
}

# Inference mode per call, as a C++ guard: the Python context manager costs a
# few microseconds a call, more than everything else neuropod adds.
_InferenceGuard: Callable[[bool], Any] | None = getattr(torch._C, "_InferenceMode", None)


# --- loading helpers --------------------------------------------------------------------------------


def _model_file(package: Package, where: str, what: str) -> Path:
    path = package.data_dir / MODEL_FILE
    if not path.is_file():
        raise PackageError(f"{where}: the {what} 0/data/{MODEL_FILE} is missing")
    return path


def _call_names(package: Package, in_spec: Any, where: str, fallback: Sequence[str]) -> tuple[list[str], list[str]]:
    """(positional names, keyword names in the program's flattening order) of ``forward``'s inputs."""
    if not (in_spec.type is tuple and in_spec.num_children == 2):
        raise PackageError(f"{where}: the program's input structure {in_spec} is not (args, kwargs)")
    args_spec, kwargs_spec = tree_children(in_spec)
    n_args = args_spec.num_children
    kw_names = [str(k) for k in (kwargs_spec.context or [])]
    leaves = [*tree_children(args_spec), *tree_children(kwargs_spec)]
    if not all(s.is_leaf() for s in leaves):
        raise PackageError(
            f"{where}: forward takes nested inputs ({in_spec}); neuropod passes one tensor per input name, so "
            "forward must take one tensor per argument"
        )
    recorded = package.backend_config.get("args")
    if isinstance(recorded, list) and all(isinstance(n, str) for n in recorded):
        args = list(recorded)
        if len(args) != n_args:
            raise PackageError(
                f"{where}: forward takes {n_args} positional input(s), but 0/config.json names {len(args)} "
                f"({', '.join(args)}); package the model again"
            )
    else:  # no record (a compiled package given as it is): forward's own names, else the spec's order
        args = list(fallback)[:n_args]
        if len(args) != n_args:
            raise SpecError(
                f"{where}: the program takes {n_args} positional input(s), but the input spec describes "
                f"{len(args)} ({', '.join(args) or 'none'}) besides its keyword inputs"
            )
    names = [*args, *kw_names]
    spec_names = [s.name for s in package.config.input_spec]
    if sorted(names) != sorted(spec_names):
        extra = [n for n in names if n not in spec_names]
        missing = [n for n in spec_names if n not in names]
        problems = []
        if extra:
            problems.append(f"forward takes {', '.join(map(repr, extra))} that the input spec does not describe")
        if missing:
            problems.append(f"the input spec has {', '.join(map(repr, missing))} that forward does not take")
        raise SpecError(f"{where}: the program's inputs ({', '.join(names)}) do not match the input spec: {'; '.join(problems)}")
    return args, kw_names


def tree_children(spec: Any) -> list[Any]:
    """A pytree TreeSpec's child specs (``children()`` in newer torch, ``children_specs`` in older)."""
    children = getattr(spec, "children", None)
    return list(children() if callable(children) else spec.children_specs)


def output_picks(
    out_spec: Any, output_spec: Sequence[TensorSpec], where: str, *, flat: bool = False
) -> list[tuple[str, tuple[Any, ...]]]:
    """For each output name, the keys that pick it out of what ``forward`` returns (``result[k1][k2]...``),
    or with ``flat``, out of the flat list of output tensors (``(index,)``)."""
    n = out_spec.num_leaves
    structure = pytree.tree_unflatten(list(range(n)), out_spec)
    names = [s.name for s in output_spec]
    items: list[tuple[str, tuple[Any, ...]]] = []
    if isinstance(structure, dict):
        items = [(str(k), (k,)) for k in structure]
    elif isinstance(structure, int):
        if len(names) != 1:
            raise SpecError(
                f"{where}: forward returns a single tensor, but the output spec has {len(names)} outputs "
                f"({', '.join(names) or 'none'}); return a dict of name -> tensor"
            )
        items = [(names[0], ())]
    elif isinstance(structure, tuple) and hasattr(structure, "_fields"):
        items = [(str(f), (i,)) for i, f in enumerate(structure._fields)]
    elif isinstance(structure, (tuple, list)) and structure and all(isinstance(d, dict) for d in structure):
        seen: set[str] = set()
        for i, d in enumerate(structure):
            for k in d:
                if str(k) in seen:
                    raise SpecError(
                        f"{where}: forward returns output {str(k)!r} twice, in two of the dicts of the tuple it "
                        "returns; each output name must come once"
                    )
                seen.add(str(k))
                items.append((str(k), (i, k)))
    elif isinstance(structure, (tuple, list)) and all(isinstance(v, int) for v in structure):
        if len(structure) != len(names):
            raise SpecError(
                f"{where}: forward returns a {type(structure).__name__} of {len(structure)} tensors, but the output "
                f"spec has {len(names)} outputs ({', '.join(names)}); return a dict of name -> tensor"
            )
        items = [(name, (i,)) for i, name in enumerate(names)]
    if not items or not all(isinstance(_pick(structure, keys), int) for _, keys in items):
        raise SpecError(
            f"{where}: forward returns {out_spec}, which the output spec cannot describe; return a dict of name -> "
            "tensor, a single tensor, a named tuple, a tuple of dicts, or a tuple of tensors in output-spec order"
        )
    produced = [name for name, _ in items]
    extra = [n for n in produced if n not in names]
    missing = [n for n in names if n not in produced]
    if extra or missing:
        problems = []
        if missing:
            problems.append(f"the output spec has {', '.join(map(repr, missing))} that forward does not return")
        if extra:
            problems.append(f"forward returns {', '.join(map(repr, extra))} that the output spec does not describe")
        raise SpecError(f"{where}: the program's outputs ({', '.join(produced)}) do not match the output spec: {'; '.join(problems)}")
    return [(name, (_pick(structure, keys),)) for name, keys in items] if flat else items


def _pick(value: Any, keys: tuple[Any, ...]) -> Any:
    for k in keys:
        value = value[k]
    return value


# --- the two kinds of model ------------------------------------------------------------------------


class _TorchModel:
    """What both platforms share: input conversion, the call, output picking."""

    platform = ""
    #: The framework's object (the ExportedProgram, or the AOTInductor runner), held while loaded.
    program: Any = None
    #: torch_export: the program's ``.module()``, which the model calls (or calls the forward of).
    module: Any = None
    #: A CPU model whose forward takes positional inputs only (torch_export's common call).
    _positional_cpu = False

    def __init__(
        self, package: Package, device: torch.device, where: str, call: Callable[..., Any], args: Sequence[str],
        kwargs: Sequence[str], picks: list[tuple[str, tuple[Any, ...]]], inference_mode: bool,
    ):  # fmt: skip
        config = package.config
        self.name = package.name
        self.where = where
        self.device = device
        self._call = call
        self._args = list(args)
        self._kwargs = list(kwargs)
        self._order = [*args, *kwargs]
        self._picks = picks
        self._pick_of = dict(picks)
        # The common case, read with one subscript per output: what forward returns is a dict (or a
        # flat list, for AOTInductor), and the model runs on the CPU.
        self._cpu = device.type == "cpu"
        self._one_key = [(name, keys[0]) for name, keys in picks] if all(len(k) == 1 for _, k in picks) else None
        self._inference_mode = inference_mode and _InferenceGuard is not None
        for spec in config.input_spec:
            if spec.dtype == "string":
                raise SpecError(f"{where}: input {spec.name!r} is a string tensor; {self.platform} programs take tensors only")
        on_gpu = device.type != "cpu"
        # Inputs go to the model's GPU unless the package keeps them on the CPU (input_tensor_device).
        self._convert = {
            s.name: gpu_model_input(device if config.input_tensor_device.get(s.name, "GPU") != "CPU" else _CPU)
            if on_gpu else torch.from_numpy
            for s in config.input_spec
        }  # fmt: skip

    def _inputs(self, inputs: Mapping[str, Any]) -> list[Any]:
        try:
            if self._cpu:  # the core hands a CPU model numpy arrays only
                from_numpy = torch.from_numpy
                return [from_numpy(inputs[n]) for n in self._order]
            convert = self._convert
            return [convert[n](inputs[n]) for n in self._order]
        except KeyError:
            missing = [n for n in self._order if n not in inputs]
            if not missing:
                raise
            raise SpecError(
                f"Model {self.name!r} needs input(s) {', '.join(map(repr, missing))}: a {self.platform} program "
                "takes every input it was exported with"
            ) from None

    def _outputs(self, result: Any, requested: Sequence[str] | None, output_device: str | None) -> dict[str, Any]:
        if self._cpu and requested is None and self._one_key is not None:
            return {name: result[key].numpy() for name, key in self._one_key}
        picks = self._picks if requested is None else [(n, self._pick_of[n]) for n in requested]
        out: dict[str, Any] = {}
        for name, keys in picks:
            value = result
            for k in keys:
                value = value[k]
            if output_device is not None:  # left on the model's GPU, as a torch tensor (DLPack-capable)
                out[name] = value if value.device == self.device else value.to(self.device)
            elif value.device.type != "cpu":
                out[name] = value.cpu().numpy()
            else:
                out[name] = value.numpy()
        return out

    def close(self) -> None:
        # Dropping the last references frees the program's memory; on a GPU, torch's caching
        # allocator then holds it until empty_cache() hands the unused blocks back to the driver.
        self.__dict__.pop("_call", None)
        self.__dict__.pop("program", None)
        self.__dict__.pop("module", None)
        release_gpu_memory(self.device)


class ExportedModel(_TorchModel):
    """A ``torch.export`` program, run with its ``.module()``."""

    platform = "torch_export"

    def run(self, inputs: Mapping[str, Any], requested: Sequence[str] | None, output_device: str | None = None) -> dict[str, Any]:
        one_key = self._one_key
        if one_key is not None and self._positional_cpu and requested is None:
            # The common call, written out: numpy in, positional tensors, numpy out, no helper frames.
            try:
                result = self._call(*map(torch.from_numpy, map(inputs.__getitem__, self._order)))
            except KeyError:
                self._inputs(inputs)  # says which input is missing
                raise
            if len(one_key) == 1:
                name, key = one_key[0]
                return {name: result[key].numpy()}
            return {name: result[key].numpy() for name, key in one_key}
        args = self._inputs(inputs)
        guard = _InferenceGuard(True) if self._inference_mode else None  # type: ignore[misc]
        try:
            if self._kwargs:
                n = len(self._args)
                result = self._call(*args[:n], **dict(zip(self._kwargs, args[n:])))
            else:
                result = self._call(*args)
            return self._outputs(result, requested, output_device)
        finally:
            del guard

    @classmethod
    def load(cls, package: Package, device: str, options: Mapping[str, Any]) -> ExportedModel:
        where = f"Model {package.name!r} ({package.source})"
        path = _model_file(package, where, "torch.export program")
        check_load_options(options, LOAD_OPTIONS, cls.platform)
        dev = check_device(device, where)
        check_archive(path, cls.platform, where, torch)
        load_torch_libraries(package.custom_op_paths, where)  # the program names their ops
        _check_ops(path, package, where)
        try:
            with _quiet_load():
                program = torch.export.load(str(path))
            if dev.type != "cpu":
                from torch.export.passes import move_to_device_pass

                program = move_to_device_pass(program, dev)
            module = program.module()
        except NeuropodError:
            raise
        except Exception as e:
            raise BackendError(f"{where}: torch {torch.__version__} could not load 0/data/{MODEL_FILE}: {_reason(e)}") from e
        fallback = [p for p in _forward_parameters(module)]
        args, kwargs = _call_names(package, program.call_spec.in_spec, where, fallback)
        picks = output_picks(program.call_spec.out_spec, package.config.output_spec, where)
        for p in module.parameters():
            p.requires_grad_(False)
        # On the CPU the inputs are numpy arrays (the core converts other tensors), so with the weights
        # frozen nothing asks autograd for anything: no per-call inference-mode guard is needed there.
        # Tensors a caller passes on a GPU may require grad, so GPU models run in inference mode.
        # The module checks its inputs twice: a forward pre-hook matches their structure against the
        # program's and, where the program holds no guards of its own, checks their sizes against its
        # shape constraints; torch releases that export with guards (2.9 and later) run them inside the
        # graph, in forward itself. Neuropod always passes one tensor per argument, in the program's
        # order, so with guards in the graph forward alone checks everything the hook would, and calling
        # it skips nn.Module's hook dispatch: half the cost of a small model's call.
        call = module.forward if _guards_in_graph(module) else module
        model = cls(package, dev, where, call, args, kwargs, picks, inference_mode=dev.type != "cpu")
        model._positional_cpu = model._cpu and not kwargs
        model.module = module
        model.program = program
        return model


class AotiModel(_TorchModel):
    """An AOTInductor package: compiled code for one torch release and one kind of device."""

    platform = "aoti"

    def run(self, inputs: Mapping[str, Any], requested: Sequence[str] | None, output_device: str | None = None) -> dict[str, Any]:
        # The runner takes the flat input list and returns the flat outputs: what
        # AOTICompiledModel.__call__ does, without parsing the call spec on every call.
        return self._outputs(self._call(self._inputs(inputs)), requested, output_device)

    @classmethod
    def load(cls, package: Package, device: str, options: Mapping[str, Any]) -> AotiModel:
        where = f"Model {package.name!r} ({package.source})"
        path = _model_file(package, where, "AOTInductor package")
        opts = check_load_options(options, AOTI_LOAD_OPTIONS, cls.platform)
        metadata = aoti_metadata(path, where)
        check_archive(path, cls.platform, where, torch)
        compiled_for = str(metadata.get("AOTI_DEVICE_KEY", "cpu"))
        _check_compiled_for(package, compiled_for, metadata, device, where)
        dev = check_device(device, where)
        load_torch_libraries(package.custom_op_paths, where)  # the compiled code calls their ops
        from torch._inductor.package.package import load_package

        try:
            with _quiet_load():  # torch warns of a CPU unlike the compiling one; _check_compiled_for judged it
                runner = load_package(
                    str(path), model_name="model", run_single_threaded=False, num_runners=opts.get("num_runners", 1),
                    device_index=dev.index if dev.index is not None else -1,
                )  # fmt: skip
            loader = runner.loader
            in_spec, out_spec = (pytree.treespec_loads(s) for s in loader.get_call_spec())
        except NeuropodError:
            raise
        except Exception as e:
            raise BackendError(
                f"{where}: torch {torch.__version__} could not load the AOTInductor package 0/data/{MODEL_FILE}: "
                f"{_reason(e)}"
            ) from e
        # A package made from a compiled .pt2 records no names: its positional inputs come in input-spec order.
        kw_names = {str(k) for k in (tree_children(in_spec)[1].context or [])} if in_spec.num_children == 2 else set()
        spec_order = [s.name for s in package.config.input_spec if s.name not in kw_names]
        args, kwargs = _call_names(package, in_spec, where, spec_order)
        picks = output_picks(out_spec, package.config.output_spec, where, flat=True)
        # run, not boxed_run: boxed_run frees the inputs inside the compiled model, and freeing a tensor
        # made by torch.from_numpy takes the GIL, which a second caller waiting for a free runner holds
        # (torch 2.13: two threads deadlock). With run, our list keeps them until the call returns.
        model = cls(package, dev, where, loader.run, args, kwargs, picks, inference_mode=False)
        model.program = runner
        return model


def _guards_in_graph(module: Any) -> bool:
    """Whether the unlifted module's graph calls its input guards (``_guards_fn``), so that its forward
    pre-hooks only match the inputs' structure and run no checks neuropod's call needs."""
    if not isinstance(getattr(module, "_guards_fn", None), torch.nn.Module):
        return False
    return any(node.target == "_guards_fn" for node in module.graph.find_nodes(op="call_module"))


def _check_ops(path: Path, package: Package, where: str) -> None:
    """Every operator the program calls must be registered, or torch's loader fails with a vaguer message."""
    missing = []
    for target in program_ops(path, where):
        parts = target.split(".")  # torch.ops.<namespace>.<name>[.<overload>]
        packet = getattr(getattr(torch.ops, parts[2], None), parts[3], None) if len(parts) >= 4 else None
        if packet is None or (len(parts) > 4 and not hasattr(packet, parts[4])):
            missing.append(f"{parts[2]}::{'.'.join(parts[3:])}" if len(parts) >= 4 else target)
    if missing:
        libs = ", ".join(p.name for p in package.custom_op_paths) or "none"
        raise BackendError(
            f"{where}: the program calls operator(s) {', '.join(missing)}, which torch {torch.__version__} does not "
            f"have (custom-op libraries in the package: {libs}); package the library that defines them with "
            "custom_ops=[...], or load a torch release that has them"
        )


@contextlib.contextmanager
def _quiet_load() -> Iterator[None]:
    """torch's loaders log as warnings what neuropod reports itself: torch.export.load a failed read (with
    its traceback, before trying an older format), aoti_load_package a CPU unlike the compiling one."""
    logger = logging.getLogger("torch.export")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _forward_parameters(module: Any) -> list[str]:
    import inspect

    try:
        return [p.name for p in inspect.signature(module.forward).parameters.values()]
    except (TypeError, ValueError):
        return []


def _check_compiled_for(package: Package, compiled_for: str, metadata: Mapping[str, Any], device: str, where: str) -> None:
    """Refuse a device the package was not compiled for, and a CPU it was not compiled to run on."""
    kind = "cpu" if device == "cpu" else "cuda"
    if compiled_for != kind:
        raise NeuropodError(
            f"{where}: the AOTInductor package was compiled for {compiled_for}, so it cannot run on {device}; "
            + ("load it with device='cpu'" if compiled_for == "cpu" else "load it on a machine with an NVIDIA GPU")
            + f" (or compile it again with create_aoti_neuropod(..., device={kind!r}))"
        )
    if kind == "cpu":
        import platform
        import sys

        from torch._inductor.cpu_vec_isa import pick_vec_isa

        problem = isa_problem(metadata, sys.platform, platform.machine(), str(pick_vec_isa()))
        if problem:
            raise NeuropodError(f"{where}: the AOTInductor package cannot run on this CPU: {problem}")


#: Instruction sets that imply others (a package built for AVX2 runs where AVX-512 does).
_ISA_IMPLIES = {"AVX512": {"AVX2"}}


def isa_problem(metadata: Mapping[str, Any], host_platform: str, host_machine: str, host_isa: str) -> str | None:
    """Why a CPU package compiled on the machine ``metadata`` describes cannot run on this one, or None.

    Inductor compiles CPU code for the compiling machine's vector instruction set
    (and with ``-march=native``), so a package can hold instructions another CPU lacks.
    """
    built_platform = str(metadata.get("AOTI_PLATFORM", "") or host_platform)
    built_machine = str(metadata.get("AOTI_MACHINE", "") or host_machine)
    if (built_platform, built_machine) != (host_platform, host_machine):
        return f"it was compiled for {built_platform} {built_machine}, and this is {host_platform} {host_machine}"
    needed = set(str(metadata.get("AOTI_CPU_ISA", "")).upper().split())
    have = set(host_isa.upper().split())
    for isa in list(have):
        have |= _ISA_IMPLIES.get(isa, set())
    lacking = sorted(needed - have)
    if lacking:
        return (
            f"it was compiled for a CPU with {' '.join(sorted(needed))}, and this CPU lacks {' '.join(lacking)} "
            f"(it has {host_isa.upper() or 'no vector extensions torch uses'}); compile it on (or for) this kind of CPU"
        )
    return None


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text[:2000]}" if text else type(e).__name__
