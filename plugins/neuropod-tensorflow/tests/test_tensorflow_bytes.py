"""bytes tensors through TensorFlow: fed to tf.string as they are (no UTF-8), and tf.string outputs as bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

import neuropod
from neuropod.packagers import create_tensorflow_neuropod
from neuropod.spec import to_bytes_array

from conftest import spec

# Four-byte records, not UTF-8, with NULs at the end of some.
RECORDS = [b"\xff\xd8\xff\xe0", b"\x00\x01\x02\x00", b"\x80\x81\x00\x00"]
SUFFIX = b"\x00\xfe"


class Records(tf.Module):
    """raw = the records' bytes as uint8 (tf.io.decode_raw), length = their lengths, tagged = record + suffix."""

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="records")])
    def serving_default(self, records: tf.Tensor) -> dict[str, tf.Tensor]:
        return {
            "raw": tf.io.decode_raw(records, tf.uint8),
            "length": tf.strings.length(records),
            "tagged": tf.strings.join([records, tf.constant(SUFFIX)]),
        }


def doubled_graph_def() -> tf.compat.v1.GraphDef:
    """A frozen graph on a 0-d tf.string: doubled = blob + blob."""
    graph = tf.Graph()
    with graph.as_default():
        blob = tf.compat.v1.placeholder(tf.string, [], name="blob")
        tf.strings.join([blob, blob], name="doubled")
    return graph.as_graph_def()


def test_saved_model_takes_and_gives_bytes(tmp_path: Path) -> None:
    out_spec = spec(("raw", "uint8", ["n", 4]), ("length", "int32", ["n"]), ("tagged", "bytes", ["n"]))
    expected_raw = np.frombuffer(b"".join(RECORDS), np.uint8).reshape(len(RECORDS), 4)
    expected_tagged = [r + SUFFIX for r in RECORDS]
    path = create_tensorflow_neuropod(
        tmp_path / "records", "records", spec(("records", "bytes", ["n"])), out_spec, trackable_obj=Records(),
        test_input_data={"records": to_bytes_array(RECORDS)},
        test_expected_out={"raw": expected_raw, "length": np.array([4, 4, 4], np.int32), "tagged": to_bytes_array(expected_tagged)},
    )  # fmt: skip
    with neuropod.load_neuropod(path) as model:
        out = model.infer({"records": to_bytes_array(RECORDS)})
    np.testing.assert_array_equal(out["raw"], expected_raw)
    assert out["length"].tolist() == [4, 4, 4]
    assert out["tagged"].dtype == object and out["tagged"].tolist() == expected_tagged  # bytes, not decoded
    assert all(type(b) is bytes for b in out["tagged"].flat)


@pytest.mark.parametrize("use_ope", [False, True], ids=["in-process", "worker"])
def test_frozen_graph_0d_bytes(tmp_path: Path, use_ope: bool) -> None:
    path = create_tensorflow_neuropod(
        tmp_path / "doubled", "doubled", spec(("blob", "bytes", [])), spec(("doubled", "bytes", [])),
        graph_def=doubled_graph_def(), node_name_mapping={"blob": "blob", "doubled": "doubled"},
    )  # fmt: skip
    blob = b"\xff\x00\xd9\x00"
    with neuropod.load_neuropod(path, use_ope=use_ope) as model:
        out = model.infer({"blob": to_bytes_array(blob)})["doubled"]
    assert out.shape == () and out.dtype == object and out.item() == blob + blob
