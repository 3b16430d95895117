"""The pure parts of ``neuropod compare``: candidates, ``--map``, the spec check, inputs, agreement, JSON.

No framework here: specs are TensorSpec lists, outputs plain numpy arrays, and every expected value
is computed again with numpy or plain Python.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from neuropod.comparison import inputs as ins
from neuropod.comparison.agreement import WORST_KEPT, compare_sets
from neuropod.comparison.candidates import parse_candidate, unique_labels
from neuropod.comparison.problem import Facts, ProblemMismatch, check_problem, parse_maps
from neuropod.comparison.report import write_json
from neuropod.comparison.results import (
    CandidateResult,
    Comparison,
    Latency,
    Memory,
    Throughput,
)
from neuropod.comparison.runner import _verdicts
from neuropod.comparison.text import render_table
from neuropod.errors import NeuropodError
from neuropod.spec import TensorSpec


def ts(name: str, dtype: str = "float32", *shape: int | str | None) -> TensorSpec:
    return TensorSpec(name, dtype, tuple(shape))


# --- candidates ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "target", "label", "backend", "device", "ope"),
    [
        ("adder.neuropod", "adder.neuropod", "adder", None, None, False),
        ("adder.zip@onnx", "adder.zip", "adder@onnx", "onnx", None, False),
        ("adder.neuropod@onnx==1.20.1@cpu", "adder.neuropod", "adder@onnx==1.20.1@cpu", "onnx==1.20.1", "cpu", False),
        ("fast=adder.neuropod@cuda:1@ope", "adder.neuropod", "fast", None, "cuda:1", True),
        ("m/adder.neuropod@ope", "m/adder.neuropod", "adder@ope", None, None, True),
        ("s3://bucket/models/adder.zip@torch>=2.1", "s3://bucket/models/adder.zip", "s3://bucket/models/adder.zip@torch>=2.1",
         "torch>=2.1", None, False),
    ],
)  # fmt: skip
def test_a_candidate_is_read_with_its_pins(text, target, label, backend, device, ope) -> None:
    c = parse_candidate(text)
    assert (c.target, c.label, c.backend, c.device, c.use_ope, c.given) == (target, label, backend, device, ope, text)


def test_a_path_that_exists_is_taken_whole(tmp_path: Path) -> None:
    odd = tmp_path / "v=2@onnx"
    odd.mkdir()
    c = parse_candidate(str(odd))
    assert (c.target, c.backend, c.label) == (str(odd), None, "v=2@onnx")


def test_use_ope_applies_to_every_package() -> None:
    assert parse_candidate("a.neuropod", use_ope=True).label == "a@ope"
    assert parse_candidate("a.neuropod", use_ope=True).use_ope


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "must be a package path or URL"),
        ("   ", "must be a package path or URL"),
        ("a.neuropod@cpu@cuda:0", "two devices (cpu, cuda:0)"),
        ("a.neuropod@onnx@torch", "two backends (onnx, torch)"),
        ("@onnx", "names no package or URL before its pins"),
        ("grpc://localhost:8001/adder@cpu", "is a served model"),
    ],
)
def test_bad_candidates_are_refused(text: str, words: str) -> None:
    with pytest.raises(NeuropodError, match=".*") as e:
        parse_candidate(text)
    assert words in str(e.value)


def test_use_ope_leaves_served_candidates_alone_and_an_ope_pin_on_one_is_refused() -> None:
    c = parse_candidate("http://localhost:8000/v2/models/adder", use_ope=True)
    assert c.remote and not c.use_ope
    with pytest.raises(NeuropodError, match="apply to packages only"):
        parse_candidate("grpc://localhost:8001/adder@ope")
    # a package URL is a package: its pins hold
    s3 = parse_candidate("s3://bucket/adder.zip@onnx", use_ope=True)
    assert not s3.remote and s3.use_ope and s3.backend == "onnx"


def test_a_label_named_like_a_folder_is_still_a_label(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "onnx").mkdir()
    monkeypatch.chdir(tmp_path)
    c = parse_candidate("onnx=onnx/model.neuropod@cpu")
    assert (c.label, c.target, c.device) == ("onnx", "onnx/model.neuropod", "cpu")


def test_labels_are_numbered_and_a_given_label_twice_is_refused() -> None:
    got = unique_labels([parse_candidate(t) for t in ("a.neuropod", "b/a.neuropod", "a.zip", "a.neuropod@ope")])
    assert [c.label for c in got] == ["a", "a#2", "a#3", "a@ope"]
    # a package whose name is its default label, given twice, is numbered like any other
    assert [c.label for c in unique_labels([parse_candidate("adder"), parse_candidate("adder")])] == [
        "adder",
        "adder#2",
    ]
    # a label the user wrote is kept; a default label that meets it is numbered
    got = unique_labels([parse_candidate(t) for t in ("x.neuropod", "x=a.neuropod", "b/x.neuropod")])
    assert [(c.label, c.target) for c in got] == [("x#2", "x.neuropod"), ("x", "a.neuropod"), ("x#3", "b/x.neuropod")]
    with pytest.raises(NeuropodError, match="Two candidates are labelled 'x'"):
        unique_labels([parse_candidate("x=a.neuropod"), parse_candidate("x=b.neuropod")])


# --- --map ---------------------------------------------------------------------------------------

LABELS = ["base", "onnx", "torch.v2"]


def test_maps_by_position_label_and_either_side() -> None:
    got = parse_maps(["2.logits=out", "onnx.in0=x", "torch.v2.y=base.out", "base.x=3.inp"], LABELS)
    assert got == {"onnx": {"logits": "out", "in0": "x"}, "torch.v2": {"y": "out", "inp": "x"}}
    assert parse_maps([], LABELS) == {}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("logits", "must be CANDIDATE.TENSOR=BASELINE_TENSOR"),
        ("2.logits=", "must be CANDIDATE.TENSOR=BASELINE_TENSOR"),
        ("=out", "must be CANDIDATE.TENSOR=BASELINE_TENSOR"),
        ("7.logits=out", "there is no candidate 7 (there are 3)"),
        ("nosuch.logits=out", "the left side must name a candidate"),
        ("1.out=logits", "renames a tensor of the baseline"),
        ("onnx.a=torch.v2.b", "one side must be the baseline ('base')"),
    ],
)
def test_bad_maps_are_refused(text: str, words: str) -> None:
    with pytest.raises(NeuropodError) as e:
        parse_maps([text], LABELS)
    assert words in str(e.value)
    assert text in str(e.value) or "no candidate" in str(e.value)


def test_a_tensor_mapped_twice_is_refused() -> None:
    with pytest.raises(NeuropodError, match=r"maps onnx\.y twice \('a', 'b'\)"):
        parse_maps(["onnx.y=a", "2.y=b"], LABELS)
    assert parse_maps(["onnx.y=a", "2.y=a"], LABELS) == {"onnx": {"y": "a"}}


# --- the spec check ------------------------------------------------------------------------------


def facts(inputs: list[TensorSpec], outputs: list[TensorSpec], renames: dict[str, str] | None = None) -> Facts:
    return Facts(inputs, outputs, renames=renames or {})


BASE = facts([ts("x", "float32", "batch", 3), ts("ids", "int64", "batch")], [ts("out", "float32", "batch", 4)])


def test_the_same_problem_passes_and_symbol_names_may_differ() -> None:
    assert check_problem(["a", "b"], [BASE, BASE]) == []
    other = facts([ts("x", "float32", "N", 3), ts("ids", "int64", "N")], [ts("out", "float32", "N", 4)])
    assert check_problem(["a", "b"], [BASE, other]) == ["b: symbol 'N' is the baseline's 'batch'"]


def test_none_and_a_symbol_against_a_fixed_size_fit_and_are_noted() -> None:
    other = facts([ts("x", "float32", None, 3), ts("ids", "int64", 8)], [ts("out", "float32", None, None)])
    notes = check_problem(["a", "b"], [BASE, other])
    assert notes == ["b's input 'ids': axis 0 is 8 here and 'batch' in the baseline"]


def test_a_symbol_fixed_in_one_tensor_still_maps_to_a_symbol_in_another() -> None:
    # The candidate fixes 'ids' at 8 rows but keeps 'batch' for 'x' and 'out': both fit the baseline.
    other = facts([ts("x", "float32", "batch", 3), ts("ids", "int64", 8)], [ts("out", "float32", "batch", 4)])
    assert check_problem(["a", "b"], [BASE, other]) == ["b's input 'ids': axis 0 is 8 here and 'batch' in the baseline"]
    # A symbol that stands for two of the baseline's symbols does not.
    two = facts([ts("x", "float32", "n", 3), ts("ids", "int64", "n")], [ts("out", "float32", "n", "n")])
    base = facts([ts("x", "float32", "batch", 3), ts("ids", "int64", "batch")], [ts("out", "float32", "batch", "k")])
    with pytest.raises(ProblemMismatch, match="symbol 'n' stands for 'batch' elsewhere and for 'k'"):
        check_problem(["a", "b"], [base, two])


def test_every_difference_is_listed() -> None:
    other = facts(
        [ts("x", "float64", "batch", 3), ts("ids", "int64", "batch", 1), ts("extra", "bool", 2)],
        [ts("logits", "float32", "batch", 5)],
    )
    with pytest.raises(ProblemMismatch) as e:
        check_problem(["a", "b"], [BASE, other])
    assert e.value.differences == [
        "b has an input 'extra' the baseline does not have (extra: bool [2])",
        "b's input 'ids' has shape [batch, 1], the baseline's [batch] (another rank)",
        "b's input 'x' is float64, the baseline's is float32",
        "b has no output 'out' (the baseline's out: float32 [batch, 4])",
        "b has an output 'logits' the baseline does not have (logits: float32 [batch, 5])",
    ]
    message = str(e.value)
    assert message.startswith("The candidates are not the same problem (5 differences):")
    assert "--map CANDIDATE.TENSOR=BASELINE_TENSOR" in message


def test_fixed_sizes_and_symbols_must_correspond() -> None:
    other = facts([ts("x", "float32", "batch", 4), ts("ids", "int64", "batch")], [ts("out", "float32", "batch", 4)])
    with pytest.raises(ProblemMismatch) as e:
        check_problem(["a", "b"], [BASE, other])
    assert e.value.differences == ["b's input 'x' has size 4 on axis 1, the baseline's has 3"]
    # one symbol of the candidate standing for two of the baseline's
    two = facts([ts("p", "float32", "n", "m"), ts("q", "float32", "n")], [])
    one = facts([ts("p", "float32", "k", "k"), ts("q", "float32", "k")], [])
    with pytest.raises(ProblemMismatch) as e:
        check_problem(["a", "b"], [two, one])
    assert len(e.value.differences) == 1
    assert "b's symbol 'k' stands for 'n' elsewhere and for 'm' on axis 1" in e.value.differences[0]


def test_renames_make_a_renamed_tensor_comparable_and_are_noted() -> None:
    renamed = facts(
        [ts("input", "float32", "batch", 3), ts("ids", "int64", "batch")],
        [ts("logits", "float32", "batch", 4)],
        {"logits": "out", "input": "x"},
    )
    notes = check_problem(["a", "b"], [BASE, renamed])
    assert "b: its 'logits' is compared as the baseline's 'out'" in notes
    assert "b: its 'input' is compared as the baseline's 'x'" in notes
    assert renamed.to_baseline("logits") == "out" and renamed.to_baseline("ids") == "ids"


def test_a_map_onto_a_name_the_candidate_already_has_is_refused() -> None:
    other = facts([ts("x", "float32", "batch", 3), ts("inp", "float32", "batch", 3), ts("ids", "int64", "batch")],
                  BASE.outputs, {"inp": "x"})  # fmt: skip
    with pytest.raises(ProblemMismatch) as e:
        check_problem(["a", "b"], [BASE, other])
    assert e.value.differences == ["b's inputs 'x' and 'inp' would both be the baseline's 'x' (check --map)"]
    # a swap is fine
    swapped = facts(
        [ts("ids", "float32", "batch", 3), ts("x", "int64", "batch")], BASE.outputs, {"ids": "x", "x": "ids"}
    )
    assert check_problem(["a", "b"], [BASE, swapped])


def test_a_map_naming_a_tensor_that_is_not_there_is_refused() -> None:
    other = facts(BASE.inputs, BASE.outputs, {"nosuch": "out"})
    with pytest.raises(NeuropodError) as e:
        check_problem(["a", "b"], [BASE, other])
    assert "--map b.nosuch=out: candidate 'b' has no tensor 'nosuch'" in str(e.value)
    assert "its tensors: ids, out, x" in str(e.value)


# --- inputs --------------------------------------------------------------------------------------

SPEC = [
    ts("x", "float32", "batch", 3),
    ts("n", "int32", "batch"),
    ts("u", "uint8", 2),
    ts("flag", "bool", "batch"),
    ts("words", "string", "batch", None),
    ts("blob", "bytes", "batch"),
    ts("h", "float16", "other"),
]


def test_parse_dims_reads_and_checks_symbols() -> None:
    assert ins.parse_dims(["batch=5", "other=1"], SPEC) == {"batch": 5, "other": 1}
    assert ins.parse_dims([], SPEC) == {}
    for text, words in [
        ("batch", "must be SYMBOL=SIZE"),
        ("=3", "must be SYMBOL=SIZE"),
        ("batch=-1", "at least 1"),
        ("batch=0", "at least 1"),
        ("batch=two", "at least 1"),
        ("nosuch=3", "no symbol 'nosuch'; its symbols: batch, other"),
    ]:
        with pytest.raises(NeuropodError) as e:
            ins.parse_dims([text], SPEC)
        assert words in str(e.value), text
    with pytest.raises(NeuropodError, match="none: every dimension is fixed"):
        ins.parse_dims(["batch=2"], [ts("x", "float32", 2)])


def test_dims_and_batch_sizes_name_the_option_and_the_bad_value_alike() -> None:
    assert ins.parse_batch_sizes("1, 8,32") == [1, 8, 32]
    assert ins.parse_batch_sizes("") == [] and ins.parse_batch_sizes(" , ") == []
    for option, call, given, bad in [
        ("--batch-sizes", ins.parse_batch_sizes, "1,x,8", "x"),
        ("--batch-sizes", ins.parse_batch_sizes, "4,0", "0"),
        ("--batch-sizes", ins.parse_batch_sizes, "-3", "-3"),
        ("--batch-sizes", ins.parse_batch_sizes, "2.5", "2.5"),
        ("--dims", lambda text: ins.parse_dims([text], SPEC), "batch=0", "0"),
        ("--dims", lambda text: ins.parse_dims([text], SPEC), "batch=two", "two"),
        ("--dims", lambda text: ins.parse_dims([text], SPEC), "batch=2.5", "2.5"),
    ]:
        with pytest.raises(NeuropodError) as e:
            call(given)
        assert str(e.value) == f"{option} {given!r}: {bad!r} is not a whole number of at least 1"


def test_generate_follows_the_spec_and_the_seed() -> None:
    sets = ins.generate(SPEC, 3, {"batch": 5}, seed=7)
    assert len(sets) == 3
    want_shapes = {"x": (5, 3), "n": (5,), "u": (2,), "flag": (5,), "words": (5, ins.DEFAULT_SIZE), "blob": (5,),
                   "h": (ins.DEFAULT_SIZE,)}  # fmt: skip
    for one in sets:
        assert {k: v.shape for k, v in one.items()} == want_shapes
        assert one["x"].dtype == np.float32 and one["h"].dtype == np.float16
        assert one["n"].dtype == np.int32 and one["u"].dtype == np.uint8 and one["flag"].dtype == np.bool_
        assert one["n"].min() >= 0 and one["n"].max() <= 9
        assert all(
            isinstance(s, str) and s.isascii() and s.isalpha() and 1 <= len(s) <= 8 for s in one["words"].ravel()
        )
        assert all(isinstance(b, bytes) and 1 <= len(b) <= 8 for b in one["blob"].ravel())
    # sets differ from each other; the same seed gives the same sets, another seed others
    assert not np.array_equal(sets[0]["x"], sets[1]["x"])
    again = ins.generate(SPEC, 3, {"batch": 5}, seed=7)
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(sets, again) for k in a)
    assert not np.array_equal(ins.generate(SPEC, 1, {"batch": 5}, seed=8)[0]["x"], sets[0]["x"])


def test_read_npz(tmp_path: Path) -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.savez(tmp_path / "ok.npz", x=x, words=np.array(["a", "bc"]))
    got = ins.read_npz(tmp_path / "ok.npz")
    assert sorted(got) == ["words", "x"] and np.array_equal(got["x"], x) and got["words"].tolist() == ["a", "bc"]
    np.save(tmp_path / "one.npy", x)
    np.savez(tmp_path / "pickled.npz", x=np.array([{"a": 1}], dtype=object))
    (tmp_path / "junk.npz").write_bytes(b"not a zip at all")
    for name, words in [
        ("missing.npz", "no such file"),
        ("one.npy", "is a .npy file"),
        ("pickled.npz", "not a readable .npz archive without pickles"),
        ("junk.npz", "not a readable .npz archive"),
    ]:
        with pytest.raises(NeuropodError) as e:
            ins.read_npz(tmp_path / name)
        assert f"--inputs {tmp_path / name}" in str(e.value) and words in str(e.value), name
        assert "\n" not in str(e.value)


def test_check_sets_names_what_is_missing_and_extra() -> None:
    spec = [ts("x"), ts("y")]
    ins.check_sets([{"x": np.float32(0), "y": np.float32(0)}], spec, "a.npz")
    with pytest.raises(NeuropodError) as e:
        ins.check_sets(
            [{"x": np.float32(0), "y": np.float32(0)}, {"x": np.float32(0), "z": np.float32(0)}], spec, "--inputs"
        )
    assert str(e.value) == ("The inputs of --inputs, set 2 misses y and has z, which the baseline does not take; "
                            "the baseline's inputs: x, y")  # fmt: skip


def test_check_sets_checks_dtypes_and_shapes_against_the_spec() -> None:
    spec = [ts("x", "float32", "b", 2), ts("y", "float32", "b")]
    ok = {"x": np.zeros((3, 2), np.float32), "y": np.zeros(3, np.float32)}
    ins.check_sets([ok], spec, "a.npz")
    ins.check_sets(ins.generate(SPEC, 2, {"batch": 3}, seed=1), SPEC, "generated")  # every dtype generated fits
    for bad, words in [
        ({**ok, "x": ok["x"].astype(np.float64)}, "Tensor 'x' in the input spec is expected to be of type float32"),
        (
            {**ok, "x": np.zeros((3, 5), np.float32)},
            "Dim 1 of tensor 'x' in the input spec is expected to be of size 2",
        ),
        ({**ok, "y": np.zeros(4, np.float32)}, "'b'"),
    ]:
        with pytest.raises(NeuropodError) as e:
            ins.check_sets([bad], spec, "a.npz")
        assert str(e.value).startswith("The inputs of a.npz do not fit the baseline's spec: ") and words in str(e.value)


def test_batch_axis_is_the_symbol_every_input_starts_with() -> None:
    assert ins.batch_axis([ts("x", "float32", "b", 3), ts("y", "int64", "b")]) == "b"
    assert ins.batch_axis([ts("x", "float32", "b", 3), ts("y", "int64", "c")]) is None
    assert ins.batch_axis([ts("x", "float32", 4, 3)]) is None
    assert ins.batch_axis([ts("x", "float32", "b"), ts("s", "float32")]) is None
    assert ins.batch_axis([ts("x", "float32", None, 3)]) is None
    assert ins.batch_axis([]) is None


def test_batch_of_repeats_and_cuts_rows() -> None:
    one = {"x": np.arange(6).reshape(3, 2), "w": np.array(["a", "b", "c"], dtype=object)}
    five = ins.batch_of(one, 5)
    rows = [0, 1, 2, 0, 1]  # by hand
    assert five["x"].tolist() == [one["x"][r].tolist() for r in rows]
    assert five["w"].tolist() == ["a", "b", "c", "a", "b"]
    assert ins.batch_of(one, 2)["x"].tolist() == [[0, 1], [2, 3]]
    with pytest.raises(NeuropodError, match="Input 'x' has no rows to make a batch of 4"):
        ins.batch_of({"x": np.zeros((0, 2))}, 4)
    with pytest.raises(NeuropodError, match="no rows"):
        ins.batch_of({"x": np.float32(1)}, 4)


def test_sets_round_trip_without_pickles(tmp_path: Path) -> None:
    words = np.empty((2, 2), dtype=object)
    words[:] = [["ab\0", ""], ["é€\0\0", "x y"]]
    blobs = np.empty(4, dtype=object)
    blobs[:] = [b"a\0\0", b"", b"\0", b"\xff\x00z"]
    sets = [
        {"x": np.arange(6, dtype=np.float16).reshape(2, 3), "words": words, "blob": blobs,
         "InceptionV3/Predictions/Softmax:0": np.array([True, False])},
        {"x": np.zeros((0, 3), np.float32), "words": np.array("scalar\0"), "blob": np.array([b"z"], dtype="S1"),
         "InceptionV3/Predictions/Softmax:0": np.array([], dtype=bool), "u": np.array(["fixed", "w"])},
    ]  # fmt: skip
    path = tmp_path / "sets.npz"
    ins.save_sets(path, sets)
    with np.load(path, allow_pickle=False) as data:  # readable without pickles
        assert all(data[k].dtype.kind != "O" for k in data.files)
    back = ins.load_sets(path)
    assert len(back) == 2
    for want, got in zip(sets, back):
        assert sorted(want) == sorted(got)
        for k in want:
            w, g = np.asarray(want[k]), got[k]
            assert g.shape == w.shape, k
            assert g.ravel().tolist() == w.ravel().tolist(), k
            if w.dtype.kind not in "OSU":
                assert g.dtype == w.dtype, k
    assert back[0]["words"][1, 0] == "é€\0\0" and back[0]["blob"].tolist() == [b"a\0\0", b"", b"\0", b"\xff\x00z"]


# --- agreement -----------------------------------------------------------------------------------


def _by_hand(want: np.ndarray, got: np.ndarray, rtol: float, atol: float) -> tuple[int, float, tuple[int, ...]]:
    """Elements outside, max abs error and the worst element's index, element by element in Python."""
    outside, worst, where = 0, -1.0, ()
    for index in np.ndindex(*want.shape):
        w, g = float(want[index]), float(got[index])
        err = abs(g - w)
        if err > atol + rtol * abs(w):
            outside += 1
            if err > worst:
                worst, where = err, index
    return outside, worst, where


def test_float_outputs_within_and_outside_the_tolerance() -> None:
    rng = np.random.default_rng(3)
    want = [rng.standard_normal((4, 5)).astype(np.float32) for _ in range(2)]
    got = [w.copy() for w in want]
    got[0] = got[0] + np.float32(1e-6)  # within atol everywhere
    got[1][2, 3] += np.float32(0.5)
    got[1][0, 1] -= np.float32(0.01)
    spec = [ts("out", "float32", "b", 5)]
    (agreement,) = compare_sets(spec, [{"out": w} for w in want], [{"out": g} for g in got], rtol=1e-4, atol=1e-5)
    outside0, _, _ = _by_hand(want[0], got[0], 1e-4, 1e-5)
    outside1, worst1, where1 = _by_hand(want[1], got[1], 1e-4, 1e-5)
    assert outside0 == 0 and outside1 == 2 and where1 == (2, 3)
    assert (agreement.elements, agreement.outside, agreement.agrees) == (40, 2, False)
    assert agreement.share_outside == 2 / 40
    assert agreement.max_abs_error == pytest.approx(worst1, rel=1e-6)
    w0 = agreement.worst[0]
    assert (w0.input_set, w0.index) == (1, [2, 3])
    assert w0.value == pytest.approx(float(got[1][2, 3])) and w0.baseline == pytest.approx(float(want[1][2, 3]))
    assert w0.rel_error == pytest.approx(abs(float(got[1][2, 3]) - float(want[1][2, 3])) / abs(float(want[1][2, 3])))
    assert [w.index for w in agreement.worst[:2]] == [[2, 3], [0, 1]]
    assert len(agreement.worst) <= WORST_KEPT


def test_elements_outside_the_tolerance_come_first_among_the_worst() -> None:
    # large values with large errors inside rtol; one small value a little outside
    want = np.array([1000.0] * 8 + [0.0])
    got = want + np.array([0.05] * 8 + [0.001])
    (a,) = compare_sets([ts("o", "float64", 9)], [{"o": want}], [{"o": got}], rtol=1e-4, atol=1e-5)
    assert a.outside == 1
    assert a.worst[0].index == [8] and a.worst[0].rel_error is None  # against 0: no finite relative error
    assert a.max_abs_error == pytest.approx(0.05)


def test_nan_and_infinities() -> None:
    want = np.array([np.nan, np.inf, -np.inf, 1.0, 2.0], np.float32)
    same = want.copy()
    (a,) = compare_sets([ts("o", "float32", 5)], [{"o": want}], [{"o": same}], rtol=1e-4, atol=1e-5)
    assert a.agrees and a.outside == 0 and a.max_abs_error == 0.0 and a.worst == []
    got = np.array([1.0, np.inf, np.inf, np.nan, 2.0], np.float32)
    (b,) = compare_sets([ts("o", "float32", 5)], [{"o": want}], [{"o": got}], rtol=1e-4, atol=1e-5)
    assert b.outside == 3 and b.max_abs_error is None  # infinite: JSON has no infinity
    assert sorted(w.index[0] for w in b.worst) == [0, 2, 3]
    assert json.loads(json.dumps([w.__dict__ for w in b.worst], allow_nan=False))


@pytest.mark.parametrize("dtype", ["int64", "uint8", "bool"])
def test_integer_and_bool_outputs_are_compared_exactly(dtype: str) -> None:
    want = np.array([[1, 0, 1], [0, 1, 1]], dtype=dtype)
    got = want.copy()
    got[1, 2] = 0
    (a,) = compare_sets([ts("o", dtype, 2, 3)], [{"o": want}], [{"o": got}], rtol=1e9, atol=1e9)
    assert a.exact and a.outside == 1 and not a.agrees
    assert (a.worst[0].index, a.worst[0].value, a.worst[0].baseline) == ([1, 2], got[1, 2].item(), want[1, 2].item())
    assert type(a.worst[0].value) in (int, bool)


@pytest.mark.parametrize(("dtype", "want", "got"), [("int64", 3, 4), ("string", "a", "b"), ("float32", 1.0, 2.0)])
def test_a_scalar_output_is_compared(dtype: str, want: object, got: object) -> None:
    array = (lambda v: np.array(v, dtype=object)) if dtype == "string" else (lambda v: np.array(v, dtype=dtype))
    (a,) = compare_sets([ts("o", dtype)], [{"o": array(want)}], [{"o": array(got)}], rtol=1e-4, atol=1e-5)
    assert (a.elements, a.outside, a.agrees) == (1, 1, False)
    assert (a.worst[0].index, a.worst[0].value, a.worst[0].baseline) == ([], got, want)
    (same,) = compare_sets([ts("o", dtype)], [{"o": array(want)}], [{"o": array(want)}], rtol=1e-4, atol=1e-5)
    assert same.agrees and same.worst == []


def test_strings_and_bytes_are_compared_exactly() -> None:
    words = np.array(["a", "b", "c"], dtype=object)
    other = np.array(["a", "B", "c"], dtype=object)
    blobs = np.array([b"x\0", b"y"], dtype=object)
    (s, b) = compare_sets(
        [ts("s", "string", 3), ts("b", "bytes", 2)],
        [{"s": words, "b": blobs}],
        [{"s": other, "b": np.array([b"x", b"y"], dtype=object)}],
        rtol=1,
        atol=1,
    )
    assert (s.outside, s.worst[0].index, s.worst[0].value, s.worst[0].baseline) == (1, [1], "B", "b")
    assert (b.outside, b.worst[0].index, b.worst[0].value, b.worst[0].baseline) == (1, [0], "b'x'", "b'x\\x00'")


def test_a_missing_output_or_another_shape_is_a_problem() -> None:
    spec = [ts("o", "float32", None), ts("p", "float32", None)]
    base = [{"o": np.zeros(3, np.float32), "p": np.zeros(2, np.float32)}]
    (o, p) = compare_sets(spec, base, [{"o": np.zeros(4, np.float32)}], rtol=1e-4, atol=1e-5)
    assert o.problem == "shape [4] where the baseline's is [3] (input set 1)" and not o.agrees
    assert p.problem == "the candidate returned no 'p' for input set 1" and not p.agrees


# --- results as JSON -----------------------------------------------------------------------------


def test_results_round_trip_through_json_without_nan_or_infinity(tmp_path: Path) -> None:
    spec = [ts("o", "float32", 3), ts("w", "string", 2)]
    base_out = [{"o": np.array([1.0, 0.0, np.nan], np.float32), "w": np.array(["a", "b"], dtype=object)}]
    cand_out = [{"o": np.array([np.inf, 1.0, 3.0], np.float32), "w": np.array(["a", "c"], dtype=object)}]
    lat = Latency(count=3, p50=0.002, p90=0.003, p99=0.003, mean=0.002, stdev=0.0005, min=0.001, max=0.003,
                  samples=[0.001, 0.002, 0.003])  # fmt: skip
    results = [
        CandidateResult(label="a", given="a.neuropod", target="a.neuropod", latency=lat,
                        memory=Memory(rss_before_load=10, peak_rss=25)),
        CandidateResult(label="b", given="b.neuropod@onnx", target="b.neuropod", backend_pin="onnx",
                        latency=Latency(**{**lat.__dict__, "p50": 0.006}),
                        throughput=[Throughput(batch_size=4, calls=10, seconds=0.5, items_per_s=80.0, p50=0.05)]),
        CandidateResult(label="c", given="c", target="c", status="failed", error="boom", stage="load",
                        verdict="failed"),
    ]  # fmt: skip
    _verdicts(results, [base_out, cand_out, None], facts([], spec), rtol=1e-4, atol=1e-5)
    comparison = Comparison(
        candidates=results, settings={"rtol": 1e-4, "atol": 1e-5, "max_slowdown": 2.0, "rate": None},
        inputs={"source": "the inputs given", "sets": 1, "tensors": []}, problem_notes=[],
        machine={"cpu": "x", "cores": os.cpu_count(), "python": "3"}, command="neuropod compare a b c",
        date="2026-01-01T00:00:00+00:00", neuropod_version="0", method="m",
    )  # fmt: skip
    assert [c.verdict for c in results] == ["baseline", "disagrees", "failed"]
    assert results[1].slowdown == pytest.approx(3.0)
    assert [c.label for c in comparison.slow] == ["b"] and comparison.exit_code == 1
    text = write_json(comparison, tmp_path / "r.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    b = data["candidates"][1]
    assert data["slow"] == ["b"] and data["passed"] is False and data["exit_code"] == 1
    assert data["candidates"][0]["memory"]["added_rss"] == 15
    o, w = b["outputs"]
    # the NaN baseline against 3.0 and 0 against 1.0 are finite in relative error only where the baseline is
    assert (o["outside"], o["elements"], o["agrees"], o["max_abs_error"], o["max_rel_error"]) == (
        3,
        3,
        False,
        None,
        None,
    )
    assert {tuple(x["index"]) for x in o["worst"]} == {(0,), (1,), (2,)}
    assert (w["outside"], w["worst"][0]["value"], w["worst"][0]["baseline"]) == (1, "c", "b")
    assert data["candidates"][2]["error"] == "boom" and data["candidates"][2]["stage"] == "load"
    assert b["throughput"] == [{"batch_size": 4, "calls": 10, "seconds": 0.5, "items_per_s": 80.0, "p50": 0.05}]
    assert not math.isnan(b["latency"]["p50"])
    table = render_table(comparison)
    assert (
        "c: FAILED at load: boom" in table
        and "SLOW: b is 3.00x" in table
        and table.splitlines()[-1].startswith("FAILED")
    )
    assert "b: output 'w' disagrees in 1 of 2 elements" in table
