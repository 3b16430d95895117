"""The TorchScript module behind a loaded model (imports torch).

Calling conventions, read from the scripted ``forward``'s schema at load
time (as the original Neuropod supported them):

* ``forward(self, x, y, ...)``: one argument per input name. Arguments with
  a default (or ``Optional``) may be left out by the caller.
* ``forward(self, inputs: Dict[str, Tensor])``, ``Dict[str, List[str]]`` or
  ``Dict[str, Union[Tensor, List[str]]]``: one dict of every input.

String tensors travel as ``List[str]`` (so they must be 1-D). ``forward``
may return a dict of tensors and/or ``List[str]``, a single tensor or
``List[str]`` (when the output spec has exactly one entry), a named tuple, or
a tuple of dicts (a name in two of them is an error, as in the original).
"""

from __future__ import annotations

import contextlib
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuropod.errors import BackendError, NeuropodError, PackageError, SpecError
from neuropod.package import Package
from neuropod.probe import load_torch_libraries
from neuropod.spec import TensorSpec
from neuropod.torch_support import THREAD_OPTIONS, check_device, check_load_options, gpu_model_input, release_gpu_memory

MODEL_FILE = "model.pt"
_CPU = torch.device("cpu")

#: Load options this backend accepts: torch's thread counts, both process-wide.
LOAD_OPTIONS = THREAD_OPTIONS

# Inference mode per call, as a C++ guard: the Python context manager costs a
# few microseconds a call, more than everything else neuropod adds.
_InferenceGuard: Callable[[bool], Any] = getattr(torch._C, "_InferenceMode", None) or (lambda _mode: None)
_Tensor = torch.Tensor


def is_legacy_format(path: Path) -> bool:
    """TorchScript files from torch < 1.4 are zips with ``model.json`` and no ``data.pkl``."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return any(n.endswith("/model.json") for n in names) and not any(n.endswith("data.pkl") for n in names)


@contextlib.contextmanager
def quiet_jit_deprecation() -> Iterator[None]:
    """Hide torch's notice that torch.jit is deprecated (a DeprecationWarning in
    2.13, a FutureWarning from 2.14) around calls neuropod makes on the user's
    behalf: it is for model authors, not for people running packaged models."""
    with warnings.catch_warnings():
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=category)
        yield


class _Signature:
    """How to call ``forward``: by argument name, or with one dict."""

    def __init__(self, module: Any, inputs: Sequence[TensorSpec], where: str):
        try:
            schema = module.forward.schema
        except (AttributeError, RuntimeError) as e:
            raise NeuropodError(f"{where}: the TorchScript module has no scripted forward method ({e})") from None
        args = schema.arguments[1:]  # after self
        spec_names = [s.name for s in inputs]
        self.text = f"forward({', '.join(f'{a.name}: {a.type}' for a in args)})"
        self.dict_arg = len(args) == 1 and args[0].type.kind() == "DictType"
        if self.dict_arg:
            value = args[0].type.getValueType()
            kinds = [str(t) for t in value.containedTypes()] if value.kind() == "UnionType" else [str(value)]
            self.accepts_tensors = "Tensor" in kinds
            self.accepts_strings = "List[str]" in kinds
            for spec in inputs:
                ok = self.accepts_strings if spec.dtype == "string" else self.accepts_tensors
                if not ok:
                    raise SpecError(
                        f"{where}: input {spec.name!r} is {spec.dtype}, but {self.text} takes dict values of type "
                        f"{value}; string tensors travel as List[str], others as Tensor"
                    )
            self.names: list[str] = []
            return
        self.names = [a.name for a in args]
        unknown = [n for n in spec_names if n not in self.names]
        required = [a.name for a in args if not a.has_default_value() and a.type.kind() != "OptionalType"]
        unfed = [n for n in required if n not in spec_names]
        if unknown or unfed:
            problems = []
            if unknown:
                problems.append(f"the input spec has {', '.join(map(repr, unknown))} that it does not take")
                odd = [n for n in unknown if not n.isidentifier()]
                if odd:
                    problems.append(
                        f"{', '.join(map(repr, odd))} cannot be an argument name of the TorchScript backend's forward "
                        "(argument names are identifiers: no '/', ':' or '.'); take the inputs as one "
                        "Dict[str, Tensor] to keep such names"
                    )
            if unfed:
                problems.append(f"it needs {', '.join(map(repr, unfed))} that the input spec does not describe")
            raise SpecError(
                f"{where}: {self.text} does not match the input spec ({'; '.join(problems)}). Neuropod calls forward "
                "with one argument per input name, or with one Dict[str, ...] of all inputs"
            )
        self.required = required


class TorchScriptModel:
    """A loaded TorchScript module plus what ``infer`` needs to call it quickly."""

    def __init__(self, module: Any, package: Package, device: torch.device, where: str):
        config = package.config
        self.module = module
        self.name = package.name
        self.where = where
        self.device = device
        self.signature = _Signature(module, config.input_spec, where)
        self._forward = module.forward
        self._output_names = [s.name for s in config.output_spec]
        self._string_outputs = {s.name for s in config.output_spec if s.dtype == "string"}
        for spec in config.input_spec:
            if spec.dtype == "string" and len(spec.shape) != 1:
                raise SpecError(
                    f"{where}: string input {spec.name!r} has shape {spec.describe_shape()}, but TorchScript takes "
                    "string tensors as List[str], so they must be 1-D"
                )
        on_gpu = device.type != "cpu"
        # Inputs go to the model's GPU unless the package keeps them on the CPU (input_tensor_device).
        self._convert = {
            s.name: _converter(s, (device if config.input_tensor_device.get(s.name, "GPU") != "CPU" else _CPU) if on_gpu else None)
            for s in config.input_spec
        }
        # forward called with one argument per input, each named, in forward's order: the call
        # with every input, as one line written for this model (see _positional_call).
        names = self.signature.names
        self._n_args = len(names)
        takes_every_input = not self.signature.dict_arg and sorted(names) == sorted(self._convert)
        self._call_all = _positional_call(names, self._convert) if takes_every_input else None

    @classmethod
    def load(cls, package: Package, device: str, options: Mapping[str, Any]) -> TorchScriptModel:
        where = f"Model {package.name!r} ({package.source})"
        path = package.data_dir / MODEL_FILE
        if not path.is_file():
            raise PackageError(f"{where}: the TorchScript file 0/data/{MODEL_FILE} is missing")
        if is_legacy_format(path):
            raise PackageError(
                f"{where}: 0/data/{MODEL_FILE} is in TorchScript's legacy format from before torch 1.4 (it holds "
                f"model.json), and torch {torch.__version__} cannot read it. Re-export the model with torch.jit.save "
                "from torch >= 1.4, or run it with a torch older than 1.4."
            )
        check_load_options(options, LOAD_OPTIONS, "TorchScript")
        dev = check_device(device, where)
        load_torch_libraries(package.custom_op_paths, where)
        try:
            with quiet_jit_deprecation():
                module = torch.jit.load(str(path), map_location=dev)  # type: ignore[no-untyped-call]
        except Exception as e:
            raise BackendError(f"{where}: torch {torch.__version__} could not load {MODEL_FILE}: {e}") from e
        module.eval()
        for p in module.parameters():
            p.requires_grad_(False)
        return cls(module, package, dev, where)

    def run(
        self, inputs: Mapping[str, Any], requested: Sequence[str] | None, output_device: str | None = None
    ) -> dict[str, Any]:
        guard = _InferenceGuard(True)
        try:
            call_all = self._call_all
            if call_all is not None and len(inputs) == self._n_args:
                result = call_all(self._forward, inputs)
            else:
                result = self._call(inputs)
            if requested is None and output_device is None and type(result) is dict:
                # The usual answer, a dict of CPU tensors, as numpy arrays; anything else (a
                # List[str], a tensor elsewhere) takes _outputs from the start.
                out = {}
                for name, value in result.items():
                    if type(value) is not _Tensor or not value.is_cpu:
                        break
                    out[name] = value.numpy()
                else:
                    return out
            return self._outputs(result, requested, output_device)
        finally:
            del guard

    def _call(self, inputs: Mapping[str, Any]) -> Any:
        """Call forward with what the inputs are (all of them by name, a dict, or some left to defaults)."""
        convert = self._convert
        sig = self.signature
        if sig.dict_arg:
            return self._forward({name: convert[name](arr) for name, arr in inputs.items()})
        if len(inputs) == len(sig.names):
            return self._forward(*[convert[n](inputs[n]) for n in sig.names])
        missing = [n for n in sig.required if n not in inputs]
        if missing:
            raise SpecError(
                f"Model {self.name!r} needs input(s) {', '.join(map(repr, missing))}: {sig.text} has no default for them"
            )
        return self._forward(**{name: convert[name](arr) for name, arr in inputs.items()})

    def _outputs(self, result: Any, requested: Sequence[str] | None, output_device: str | None) -> dict[str, Any]:
        # What forward may return, as the original Neuropod read it: a dict; a
        # bare Tensor or List[str] when the output spec has exactly one entry; a
        # named tuple; or a tuple of dicts.
        if isinstance(result, dict):
            items: Any = result.items()
        elif isinstance(result, (torch.Tensor, list)):
            items = [(self._single_output_name(result), result)]
        elif isinstance(result, tuple) and hasattr(result, "_fields"):
            items = zip(result._fields, result)
        elif isinstance(result, tuple) and result and all(isinstance(d, dict) for d in result):
            items = self._merged(result)
        else:
            raise BackendError(
                f"Model {self.name!r} returned {_describe(result)}, which its output spec cannot describe "
                "(Torchscript model output type not supported in neuropod); forward must return a dict of name -> "
                "Tensor or List[str], a single Tensor or List[str], a named tuple, or a tuple of dicts"
            )
        out: dict[str, Any] = {}
        for name, value in items:
            if requested is not None and name not in requested:
                continue
            if isinstance(value, torch.Tensor):
                if output_device is not None:  # left on the model's GPU, as a torch tensor (DLPack-capable)
                    out[name] = value if value.device == self.device else value.to(self.device)
                    continue
                if not value.is_cpu:
                    value = value.cpu()
                out[name] = value.numpy()
            elif isinstance(value, list) and all(isinstance(v, str) for v in value):
                out[name] = np.array(value, dtype=str) if value else np.zeros(0, dtype="<U1")
            else:
                kind = f"a list of type '{_describe_items(value)}'" if isinstance(value, list) else "an invalid type"
                raise BackendError(
                    f"Model {self.name!r} returned {_describe(value)} for output {name!r}; outputs must be Tensor or "
                    f"List[str] (Neuropod got {kind} for tensor '{name}')"
                )
        return out

    def _single_output_name(self, result: Any) -> str:
        """The name of a bare Tensor or List[str] that ``forward`` returned: the only output in the spec."""
        names = self._output_names
        if len(names) == 1:
            return names[0]
        what = "a single tensor" if isinstance(result, torch.Tensor) else _describe(result)
        if not names:
            raise BackendError(
                f"Model {self.name!r} returned {what}, but its output spec is empty (Model did not return dict and "
                "output spec is empty); describe the output in the output spec"
            )
        raise BackendError(
            f"Model {self.name!r} returned {what}, but its output spec has {len(names)} outputs ({', '.join(names)}) "
            "(Model did not return dict and output spec is not size 1); return a dict of name -> tensor (or a named "
            "tuple)"
        )

    def _merged(self, dicts: tuple[dict[str, Any], ...]) -> list[tuple[str, Any]]:
        """The items of the dicts in a returned tuple; a name in two of them is an error, not an overwrite."""
        items = [kv for d in dicts for kv in d.items()]
        if len(items) != len({name for name, _ in items}):
            seen: set[str] = set()
            for name, _ in items:
                if name in seen:
                    raise BackendError(
                        f"Model {self.name!r} returned output {name!r} twice, in two of the dicts of the tuple forward "
                        f"returned (An item with name `{name}` was already returned by this model. Please ensure "
                        "your model does not have duplicate outputs)"
                    )
                seen.add(name)
        return items

    def close(self) -> None:
        # Dropping the last references frees the module's memory; on a GPU, torch's caching
        # allocator then holds it until it is handed back.
        self.__dict__.pop("module", None)
        self.__dict__.pop("_forward", None)
        release_gpu_memory(self.device)


def _converter(spec: TensorSpec, device: torch.device | None) -> Callable[[Any], Any]:
    """How an input reaches ``forward``: a ``List[str]`` for a string tensor; on a CPU model
    ``torch.from_numpy`` (the core hands a CPU model numpy arrays only); on a GPU model, see
    :func:`neuropod.torch_support.gpu_model_input` (``device`` is the CPU for an input the
    package keeps there)."""
    if spec.dtype == "string":
        return _to_str_list
    if device is None:
        return torch.from_numpy
    return gpu_model_input(device)


def _positional_call(names: Sequence[str], convert: Mapping[str, Callable[[Any], Any]]) -> Callable[[Any, Any], Any]:
    """``call(forward, inputs)``: forward with every input converted, one argument per name, in order.

    Written as Python source for these names (as :func:`neuropod.spec.SpecValidator` writes its
    checks), so a call is one line: no list built, no loop of lookups. A missing name is the
    KeyError the general call would raise.
    """
    env: dict[str, Any] = {f"c{i}": convert[name] for i, name in enumerate(names)}
    args = ", ".join(f"c{i}(i[{name!r}])" for i, name in enumerate(names))
    exec(f"def call(f, i):\n    return f({args})", env)  # our own source: names enter only as repr() literals
    call: Callable[[Any, Any], Any] = env["call"]
    return call


def _to_str_list(arr: np.ndarray) -> list[str]:
    return [str(v) for v in arr.tolist()]


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {_describe_items(value) or 'nothing'}"
    return f"a {type(value).__name__}"


def _describe_items(values: list[Any] | tuple[Any, ...]) -> str:
    return ", ".join(sorted({type(v).__name__ for v in values}))
