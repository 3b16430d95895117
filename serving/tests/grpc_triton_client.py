"""Run a plan of calls against a gRPC server with tritonclient.grpc (the official client).

Usage: ``python grpc_triton_client.py PLAN.json`` (test_grpc.py writes the plan).

It runs in its own process: tritonclient.grpc registers its own ``inference.*``
protobuf messages, which cannot share a process with neuropod_serving's.
The plan names the server and the calls; input arrays come from an ``.npz``
(BYTES tensors as numpy ``S`` arrays, so no pickle), and output arrays go to
``PLAN.npz`` as ``<call id>/<output name>``. What each call returned, or the
status and message it failed with, goes to ``PLAN.result.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException


def _value(call: dict[str, Any], client: Any, arrays: Any, out: dict[str, np.ndarray]) -> Any:
    kind = call["call"]
    headers = call.get("headers")
    if kind in ("is_server_live", "is_server_ready"):
        return getattr(client, kind)(headers=headers)
    if kind == "is_model_ready":
        return client.is_model_ready(call["model"], headers=headers)
    if kind == "get_server_metadata":
        return client.get_server_metadata(headers=headers, as_json=True)
    if kind == "get_model_metadata":
        return client.get_model_metadata(call["model"], headers=headers, as_json=True)
    assert kind == "infer", kind
    inputs = []
    for name, datatype, key in call["inputs"]:
        array = arrays[key]
        if datatype == "BYTES":
            array = array.astype(object)
        tensor = triton.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    outputs = [triton.InferRequestedOutput(n) for n in call["outputs"]] if "outputs" in call else None
    result = client.infer(call["model"], inputs, outputs=outputs, headers=headers, request_id=call.get("id", ""))
    response = result.get_response(as_json=True)
    for tensor in response["outputs"]:
        array = result.as_numpy(tensor["name"])
        out[f"{call['id']}/{tensor['name']}"] = array.astype("S") if array.dtype == object else array
    return {"outputs": [t["name"] for t in response["outputs"]], "id": response.get("id", "")}


def main(plan_path: str) -> None:
    plan = json.loads(Path(plan_path).read_text())
    root = plan.get("root_certificates")
    client = triton.InferenceServerClient(plan["url"], ssl=bool(plan.get("ssl")), root_certificates=root)
    arrays = np.load(plan["inputs"]) if plan.get("inputs") else {}
    results: dict[str, Any] = {}
    out: dict[str, np.ndarray] = {}
    for call in plan["calls"]:
        try:
            results[call["id"]] = {"ok": True, "value": _value(call, client, arrays, out)}
        except InferenceServerException as e:
            results[call["id"]] = {"ok": False, "status": str(e.status()), "message": e.message()}
    client.close()
    np.savez(plan_path[: -len(".json")] + ".npz", **out)
    Path(plan_path[: -len(".json")] + ".result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
