"""The backend conformance suite: what every backend plugin must do.

A backend's tests subclass :class:`BackendConformance` in a few lines, the
way Hydra's launcher plugins subclass ``LauncherTestSuite``::

    from neuropod.testing import BackendConformance

    class TestConformance(BackendConformance):
        platform = "onnx"
        distribution = "neuropod-onnx"
        framework_modules = ("onnxruntime",)
        dtypes = ALL_DTYPES          # the dtypes the backend runs, "string" included or not
        custom_ops = True            # and give custom_op_library()

        def make_package(self, tmp_path, name, input_spec, output_spec, **packager_kwargs):
            ...  # a real model of the platform: output "out_<s>" is a copy of input "in_<s>"

        def make_accumulator_package(self, tmp_path, name, **packager_kwargs):
            ...  # a real model with the specs of accumulator_spec(): y = acc_out = acc_in + x

This module is also a pytest plugin (registered through pytest's
``pytest11`` entry point, so it is active wherever ``neuropod`` is
installed): it parametrizes the suite over the subclass's dtypes, applies a
subclass's ``run_marks`` to the tests that need to run a model, and offers
the ``neuropod_cache`` fixture. It imports no framework, and ``import
neuropod`` does not import it.

Every test method says which hooks it exercises (:func:`covers`); the core's
meta-tests check that together they exercise every hook in
:mod:`neuropod.hookspecs`.
"""

from neuropod.testing.conformance import (
    ALL_DTYPES,
    NUMERIC_DTYPES,
    BackendConformance,
    HostTensor,
    hooks_covered,
    sample,
)
from neuropod.testing.conformance import run_in_threads as run_in_threads
from neuropod.testing.gpu import REQUIRE_GPU_ENV, assert_gpu_memory_given_back, gpu_memory_used, gpu_missing
from neuropod.testing.marks import covers

# The pytest plugin's hooks and fixture: pytest finds them on this module, the entry point's.
from neuropod.testing.plugin import neuropod_cache as neuropod_cache
from neuropod.testing.plugin import pytest_collection_modifyitems as pytest_collection_modifyitems
from neuropod.testing.plugin import pytest_configure as pytest_configure
from neuropod.testing.plugin import pytest_generate_tests as pytest_generate_tests
from neuropod.testing.plugin import pytest_runtest_setup as pytest_runtest_setup
from neuropod.testing.served import Served, oip_infer, served
from neuropod.testing.stateful import ACCUMULATOR_STATE, StatefulConformance, accumulator_spec

__all__ = [
    "ACCUMULATOR_STATE",
    "ALL_DTYPES",
    "NUMERIC_DTYPES",
    "REQUIRE_GPU_ENV",
    "BackendConformance",
    "Served",
    "HostTensor",
    "StatefulConformance",
    "accumulator_spec",
    "assert_gpu_memory_given_back",
    "covers",
    "gpu_memory_used",
    "gpu_missing",
    "hooks_covered",
    "neuropod_cache",
    "oip_infer",
    "sample",
    "served",
]
