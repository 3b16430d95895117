"""What a ``.pt2`` archive holds, checked before torch reads it: nothing is unpickled unchecked.

``torch.export.load`` and ``aoti_load_package`` read a zip of JSON, raw
tensor bytes and compiled code, but some entries are pickles and some of
those torch unpickles with ``weights_only=False``, which runs whatever code
the pickle names:

* ``data/sample_inputs/<model>.pt`` (the example inputs, always read): torch
  tries ``torch.load(weights_only=True)`` and, when that refuses the pickle,
  falls back to ``weights_only=False``;
* weights and constants marked ``use_pickle``, and legacy ``<model>.pt``
  weight/constant files: ``weights_only=False``;
* ``opaque_obj_*`` constants: ``pickle.loads``; ``custom_obj_*`` constants
  (TorchBind objects): the TorchScript unpickler.

So before torch sees an archive, :func:`check_archive` reads its listing and
JSON configs and refuses the pickled kinds, and loads the sample inputs
itself with ``weights_only=True``: torch's own first attempt on the same
bytes then succeeds and its fallback never runs. Programs that need pickled
objects (TorchBind classes, opaque objects) are refused with the reason;
package them as TorchScript, or as a ``python`` package, whose loading runs
code by design.

An AOTInductor package is compiled code: its shared library runs when it is
loaded, as a TorchScript file's code does. What guards it is the package
manifest (every file's sha256, checked on load).
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

from neuropod.errors import PackageError

_FORMAT = "archive_format"
_MODELS = "models/"
_WEIGHTS_CONFIG = "data/weights/{}_weights_config.json"
_CONSTANTS_CONFIG = "data/constants/{}_constants_config.json"
_SAMPLE_INPUTS = "data/sample_inputs/{}.pt"
_AOTI = "data/aotinductor/"
_TENSOR_CONSTANT = "tensor_"
#: At most this many bytes of a JSON config are read (a config is small; an archive is not trusted).
_MAX_JSON = 64 << 20


def check_archive(path: Path, kind: str, where: str, torch: Any) -> None:
    """Refuse an archive torch could not read safely; ``kind`` is ``"torch_export"`` or ``"aoti"``.

    :param torch: the imported torch module (for the weights-only load of the sample inputs).
    :raises PackageError: the file is not a readable ``.pt2`` archive, or it
        holds something loading it would unpickle with code execution.
    """
    rel = f"0/data/{path.name}"
    try:
        with zipfile.ZipFile(path) as zf:
            _check(zf, kind, f"{where}: {rel}", torch)
    except zipfile.BadZipFile as e:
        raise PackageError(
            f"{where}: {rel} is not a readable .pt2 archive (truncated or corrupt: {e}); package the model again"
        ) from None
    except (OSError, EOFError) as e:
        raise PackageError(f"{where}: {rel} cannot be read ({e}); package the model again") from None


def _check(zf: zipfile.ZipFile, kind: str, what: str, torch: Any) -> None:
    names = zf.namelist()
    roots = {n.split("/", 1)[0] for n in names}
    if len(roots) != 1 or not all("/" in n for n in names):
        raise PackageError(f"{what} is not a PT2 archive (its files are not under one folder)")
    prefix = roots.pop() + "/"
    inner = {n[len(prefix) :] for n in names}
    if _FORMAT not in inner or _read(zf, prefix + _FORMAT).strip() != b"pt2":
        raise PackageError(
            f"{what} is not a PT2 archive (no '{_FORMAT}' saying pt2); write it with torch.export.save "
            "or torch._inductor.aoti_compile_and_package"
        )
    models = sorted(n[len(_MODELS) : -len(".json")] for n in inner if n.startswith(_MODELS) and n.endswith(".json"))
    if kind == "aoti":
        if not any(n.startswith(_AOTI) for n in inner):
            raise PackageError(f"{what} holds no AOTInductor model (no {_AOTI}); compile it with aoti_compile_and_package")
        if models:
            raise PackageError(
                f"{what} holds torch.export program(s) ({', '.join(models)}) beside the compiled model, which "
                "aoti_load_package would deserialize too; package the AOTInductor output alone"
            )
        return
    if "model" not in models:
        raise PackageError(f"{what} holds no torch.export program named 'model'; write it with torch.export.save")
    for model in models:
        for legacy in (f"data/weights/{model}.pt", f"data/constants/{model}.pt"):
            if legacy in inner:
                raise PackageError(
                    f"{what} stores {legacy} as one pickle (the format of torch 2.7 and older), which torch "
                    "unpickles with code execution; export the model again with this torch"
                )
        _check_payloads(zf, prefix + _WEIGHTS_CONFIG.format(model), "weight", what)
        _check_payloads(zf, prefix + _CONSTANTS_CONFIG.format(model), "constant", what)
        _check_sample_inputs(zf, prefix + _SAMPLE_INPUTS.format(model), what, torch)


def _read(zf: zipfile.ZipFile, name: str, most: int = _MAX_JSON) -> bytes:
    with zf.open(name) as f:
        data = f.read(most + 1)
    if len(data) > most:
        raise PackageError(f"{name} in the archive is over {most} bytes")
    return data


def _check_payloads(zf: zipfile.ZipFile, name: str, kind: str, what: str) -> None:
    """Every weight or constant must be raw tensor bytes, not a pickle."""
    try:
        raw = _read(zf, name)
    except KeyError:
        return  # torch's reader says it is missing, in its words
    try:
        config = json.loads(raw).get("config", {})
    except (ValueError, AttributeError) as e:
        raise PackageError(f"{what}: {name.split('/', 1)[1]} is not a JSON object ({e})") from None
    if not isinstance(config, dict):
        raise PackageError(f"{what}: {name.split('/', 1)[1]} has no 'config' object")
    for fqn, entry in config.items():
        if not isinstance(entry, dict):
            raise PackageError(f"{what}: {kind} {fqn!r} has no description in {name.split('/', 1)[1]}")
        file = str(entry.get("path_name", ""))
        pickled = bool(entry.get("use_pickle"))
        if kind == "constant" and not file.startswith(_TENSOR_CONSTANT):
            raise PackageError(
                f"{what}: constant {fqn!r} is a pickled Python or TorchBind object ({file}), and loading it would "
                "unpickle it with code execution; neuropod loads programs whose constants are tensors. Package "
                "such a model as TorchScript, or as a python package"
            )
        if pickled:
            raise PackageError(
                f"{what}: {kind} {fqn!r} is stored as a pickle ({file}), which torch unpickles with "
                "weights_only=False (code execution); neuropod loads only raw tensor data. Export the model again "
                "with a plain tensor there"
            )


def _check_sample_inputs(zf: zipfile.ZipFile, name: str, what: str, torch: Any) -> None:
    try:
        data = _read(zf, name, 1 << 40)
    except KeyError:
        return
    if not data:
        return
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise PackageError(
            f"{what}: its sample inputs ({name.split('/', 1)[1]}) are a pickle that torch's weights-only loader "
            f"refuses ({type(e).__name__}: {_first_line(e)}); torch.export.load would then unpickle it with "
            "weights_only=False, which runs any code it names. The package is not loaded"
        ) from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def aoti_metadata(path: Path, where: str) -> dict[str, str]:
    """What an AOTInductor package says it was compiled for (``AOTI_DEVICE_KEY``, ``AOTI_CPU_ISA``...),
    read from its ``*_metadata.json`` without loading it; empty when it says nothing."""
    rel = f"0/data/{path.name}"
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if f"/{_AOTI}model/" in n and n.endswith("_metadata.json")]
            names.sort(key=lambda n: not n.endswith(".wrapper_metadata.json"))  # the model's own first
            for name in names:
                try:
                    data = json.loads(_read(zf, name))
                except ValueError:
                    continue
                if isinstance(data, dict):
                    return {str(k): str(v) for k, v in data.items()}
    except zipfile.BadZipFile as e:
        raise PackageError(
            f"{where}: {rel} is not a readable .pt2 archive (truncated or corrupt: {e}); package the model again"
        ) from None
    except OSError as e:
        raise PackageError(f"{where}: {rel} cannot be read ({e}); package the model again") from None
    return {}


def program_ops(path: Path, where: str) -> list[str]:
    """The operators a torch.export program calls (``"torch.ops.ns.name.overload"``), from its JSON graph.

    :raises PackageError: the program's JSON does not parse.
    """
    found: set[str] = set()
    with zipfile.ZipFile(path) as zf:
        for name in [n for n in zf.namelist() if n.split("/", 1)[-1] == _MODELS + "model.json"]:
            try:
                graph = json.loads(_read(zf, name))
            except ValueError as e:
                raise PackageError(
                    f"{where}: 0/data/{path.name} holds a program ({_MODELS}model.json) that is not JSON ({e}); "
                    "package the model again"
                ) from None
            _targets(graph, found)
    return sorted(found)


def _targets(node: Any, found: set[str]) -> None:
    if isinstance(node, dict):
        target = node.get("target")
        if isinstance(target, str) and target.startswith("torch.ops."):
            found.add(target)
        for value in node.values():
            _targets(value, found)
    elif isinstance(node, list):
        for value in node:
            _targets(value, found)
