"""Run a plan of calls with tritonclient (the official client, HTTP and gRPC) against a server.

Usage: ``python triton_driver.py PLAN.json``, from a venv with ``tritonclient[http,grpc]`` and
numpy: tritonclient pins protobuf < 7 while Ray needs 7, so it never runs in the tests' process.

The plan: ``{"http_url": "127.0.0.1:P", "grpc_url": "127.0.0.1:Q", "inputs": "arrays.npz",
"calls": [{"id", "protocol": "http"|"grpc", "call", "model", "inputs": [[name, datatype, key]],
"outputs": [names], "headers": {...}}]}``. Output arrays go to ``PLAN.npz`` as ``<id>/<output>``;
what each call returned (or the status and message it failed with) goes to ``PLAN.result.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from tritonclient.utils import InferenceServerException


def _value(call: dict[str, Any], module: Any, client: Any, arrays: Any, out: dict[str, np.ndarray]) -> Any:
    kind = call["call"]
    headers = call.get("headers")
    if kind in ("is_server_live", "is_server_ready"):
        return getattr(client, kind)(headers=headers)
    if kind == "is_model_ready":
        return client.is_model_ready(call["model"], headers=headers)
    if kind == "get_model_metadata":
        if module is triton_grpc:
            return client.get_model_metadata(call["model"], headers=headers, as_json=True)
        return client.get_model_metadata(call["model"], headers=headers)
    if kind != "infer":
        raise ValueError(f"unknown call {kind!r}: expected infer, is_server_live, is_server_ready, "
                         "is_model_ready or get_model_metadata")  # fmt: skip
    inputs = []
    for name, datatype, key in call["inputs"]:
        array = arrays[key]
        if datatype == "BYTES":
            array = array.astype(object)
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    outputs = [module.InferRequestedOutput(n) for n in call["outputs"]] if "outputs" in call else None
    result = client.infer(call["model"], inputs, outputs=outputs, headers=headers, request_id=call.get("id", ""))
    response = result.get_response(as_json=True) if module is triton_grpc else result.get_response()
    for tensor in response["outputs"]:
        array = result.as_numpy(tensor["name"])
        out[f"{call['id']}/{tensor['name']}"] = array.astype("S") if array.dtype == object else array
    return {"outputs": [t["name"] for t in response["outputs"]], "id": response.get("id", "")}


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    clients = {
        "http": (triton_http, triton_http.InferenceServerClient(plan["http_url"])) if plan.get("http_url") else None,
        "grpc": (triton_grpc, triton_grpc.InferenceServerClient(plan["grpc_url"])) if plan.get("grpc_url") else None,
    }
    arrays = np.load(plan["inputs"]) if plan.get("inputs") else {}
    results: dict[str, Any] = {}
    out: dict[str, np.ndarray] = {}
    for call in plan["calls"]:
        pair = clients[call["protocol"]]
        if pair is None:
            raise ValueError(f"call {call['id']!r} uses {call['protocol']} but the plan has no {call['protocol']}_url")
        module, client = pair
        try:
            results[call["id"]] = {"ok": True, "value": _value(call, module, client, arrays, out)}
        except InferenceServerException as e:
            results[call["id"]] = {"ok": False, "status": str(e.status()), "message": e.message()}
    for pair in clients.values():
        if pair is not None:
            pair[1].close()
    stem = plan_path[: -len(".json")]
    np.savez(stem + ".npz", **out)
    Path(stem + ".result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
