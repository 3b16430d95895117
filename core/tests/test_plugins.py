"""Plugin discovery through real entry points: broken plugins, allow and block lists."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import importlib_metadata
import pytest

from neuropod import hookimpl, hookspecs, plugins
from neuropod.errors import PluginNotInstalledError

from _toy_backend import ToyPlugin


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory on sys.path where tests install small distributions with entry points."""
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins.reset()
    yield tmp_path
    plugins.reset()
    for name in [m for m in sys.modules if m.startswith("np_test_")]:
        del sys.modules[name]


def install_dist(site: Path, dist: str, version: str, entry_points: str, modules: dict[str, str]) -> None:
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    for name, code in modules.items():
        (site / f"{name}.py").write_text(textwrap.dedent(code))


GOOD = """
    import importlib_metadata
    from neuropod import hookimpl
    from neuropod.backend import Backend

    @hookimpl
    def supported_versions():
        return [Backend("good", importlib_metadata.version("good-framework"), "good-framework")]
"""


def test_broken_plugins_are_skipped_with_a_warning_naming_them(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUROPOD_PLUGINS", "good,broken,typo,raises")  # not the plugins this venv has
    install_dist(site, "good-framework", "3.1.4", "", {})
    install_dist(site, "neuropod-good", "1.0", "[neuropod.backends]\ngood = np_test_good\n", {"np_test_good": GOOD})
    install_dist(
        site, "neuropod-broken", "0.9", "[neuropod.backends]\nbroken = np_test_broken\n",
        {"np_test_broken": "raise ImportError('needs libfoo.so')\n"},
    )
    install_dist(
        site, "neuropod-typo", "0.1", "[neuropod.backends]\ntypo = np_test_typo\n",
        {"np_test_typo": "from neuropod import hookimpl\n@hookimpl\ndef supported_version():\n    return []\n"},
    )
    install_dist(
        site, "neuropod-raises", "2.0", "[neuropod.backends]\nraises = np_test_raises\n",
        {"np_test_raises": "from neuropod import hookimpl\n@hookimpl\ndef supported_versions():\n    1 / 0\n"},
    )
    with pytest.warns(plugins.PluginWarning) as caught:
        backends = plugins.installed_backends()
    assert [(b.platform, b.version, b.plugin, b.plugin_distribution) for b in backends] == [
        ("good", "3.1.4", "good", "neuropod-good 1.0")
    ]
    failures = {f.name: f for f in plugins.plugin_failures()}
    assert set(failures) == {"broken", "typo", "raises"}
    assert failures["broken"].distribution == "neuropod-broken 0.9"
    assert "ImportError: needs libfoo.so" in failures["broken"].error
    assert "supported_version" in failures["typo"].error and "do not exist" in failures["typo"].error
    assert "ZeroDivisionError" in failures["raises"].error
    messages = " ".join(str(w.message) for w in caught)
    assert "neuropod-broken 0.9" in messages and "neuropod-typo 0.1" in messages


def test_allow_and_block_lists(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_dist(site, "good-framework", "3.1.4", "", {})
    install_dist(site, "neuropod-good", "1.0", "[neuropod.backends]\ngood = np_test_good\n", {"np_test_good": GOOD})
    install_dist(
        site, "neuropod-broken", "0.9", "[neuropod.backends]\nbroken = np_test_broken\n",
        {"np_test_broken": "raise ImportError('x')\n"},
    )
    monkeypatch.setenv("NEUROPOD_DISABLE_PLUGINS", "broken")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the blocked plugin is not even imported
        assert "good" in {b.platform for b in plugins.installed_backends()}
    plugins.reset()
    monkeypatch.delenv("NEUROPOD_DISABLE_PLUGINS")
    monkeypatch.setenv("NEUROPOD_PLUGINS", "broken")
    with pytest.warns(plugins.PluginWarning):
        assert plugins.installed_backends() == []
    plugins.reset()
    monkeypatch.setenv("NEUROPOD_PLUGINS", "")
    assert plugins.installed_backends() == [] and plugins.plugin_failures() == []


def test_register_rejects_unknown_hooks_and_bad_signatures() -> None:
    class Typo:
        @hookimpl
        def infer_model(self) -> None: ...

    class BadArgs:
        @hookimpl
        def infer(self, model, inputs, requested_outputs, surprise): ...  # type: ignore[no-untyped-def]

    with pytest.warns(plugins.PluginWarning, match="infer_model"):
        assert not plugins.register(Typo(), "typo")
    with pytest.warns(plugins.PluginWarning, match="surprise"):
        assert not plugins.register(BadArgs(), "badargs")
    plugins.get_plugin_manager().check_pending()


def test_subset_of_arguments_is_allowed() -> None:
    class Minimal:
        @hookimpl
        def supported_versions(self):  # type: ignore[no-untyped-def]
            return []

        @hookimpl
        def device_caps(self):  # type: ignore[no-untyped-def] # takes none of the hook's arguments
            return None

    assert plugins.register(Minimal(), "minimal")
    plugins.unregister("minimal")


def test_every_hook_is_documented_and_exercised() -> None:
    """Each hookspec has a docstring with its params, and the toy backend implements it (the optional
    ``infer_stream`` is the python backend's, exercised by the streaming tests)."""
    optional = ("infer_stream",)
    names = [n for n in ("supported_versions", "device_caps", "load_model", "infer", *optional)]
    for name in names:
        spec = getattr(hookspecs, name)
        assert spec.__doc__ and ":returns:" in spec.__doc__, name
        assert hasattr(ToyPlugin, name) or name in optional, name
    pm = plugins.get_plugin_manager()
    specified = [h for h in dir(pm.hook) if not h.startswith("_") and getattr(pm.hook, h).has_spec()]
    assert sorted(specified) == sorted(names)


def test_packager_for_a_missing_plugin() -> None:
    with pytest.raises(PluginNotInstalledError, match=re.escape(plugins.pip_install("neuropod-tensorflow"))):
        from neuropod.packagers import create_tensorflow_neuropod  # noqa: F401
    with pytest.raises(ImportError):  # it is an ImportError too
        from neuropod.packagers import create_foo_neuropod  # noqa: F401
    with pytest.raises(AttributeError):
        import neuropod.packagers

        neuropod.packagers.something_else  # noqa: B018


def test_install_hints() -> None:
    assert plugins.install_hint("torchscript") == plugins.pip_install("neuropod-torchscript")
    assert "no known Neuropod plugin runs platform 'caffe'" in plugins.install_hint("caffe")


def test_installed_distribution_reads_dist_info_names(site: Path) -> None:
    from neuropod.backend import installed_distribution

    install_dist(site, "Fancy.Framework_GPU", "2.13.0+cu121", "", {})
    install_dist(site, "fancy-framework", "2.12.0", "", {})
    # Names compare normalized (PEP 503), and the first name that is installed wins.
    assert installed_distribution("fancy-framework-gpu", "fancy_framework") == ("fancy-framework-gpu", "2.13.0+cu121")
    assert installed_distribution("nope", "FANCY_framework") == ("FANCY_framework", "2.12.0")
    assert installed_distribution("not-installed-anywhere") is None
    # A distribution without a .dist-info folder name to read (an egg) falls back to metadata.
    egg = site / "eggy_framework.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: eggy-framework\nVersion: 0.7\n")
    assert installed_distribution("eggy-framework") == ("eggy-framework", "0.7")


def test_install_hint_when_the_plugin_is_there_but_its_framework_is_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUROPOD_PLUGINS", "")  # only the plugin registered below
    plugins.reset()

    class NoFramework:
        @hookimpl
        def supported_versions(self):  # type: ignore[no-untyped-def]
            return []  # as a real plugin does when its framework is not installed

    try:
        assert plugins.register(NoFramework(), "tensorflow", "neuropod-tensorflow 0.4.0")
        assert plugins.install_hint("tensorflow") == "neuropod-tensorflow 0.4.0 is installed, but its framework is not: " + (
            plugins.pip_install("'neuropod-tensorflow[cpu]' (or 'neuropod-tensorflow[gpu]', or any tensorflow distribution)")
        )
        assert plugins.install_hint("onnx") == plugins.pip_install("neuropod-onnx")
    finally:
        plugins.reset()


def test_plugin_for_another_core_is_skipped_before_import(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEUROPOD_PLUGINS", "good,future")
    install_dist(site, "good-framework", "3.1.4", "", {})
    install_dist(site, "neuropod-good", "1.0", "[neuropod.backends]\ngood = np_test_good\n", {"np_test_good": GOOD})
    install_dist(
        site, "neuropod-future", "2.0", "[neuropod.backends]\nfuture = np_test_future\n",
        {"np_test_future": "raise AssertionError('a plugin for another core must not be imported')\n"},
    )
    for dist, requires in (("neuropod_good-1.0", "neuropod<0.5,>=0.4"), ("neuropod_future-2.0", "neuropod>=0.9")):
        meta = site / f"{dist}.dist-info" / "METADATA"
        meta.write_text(meta.read_text() + f"Requires-Dist: numpy\nRequires-Dist: {requires}\n\nneuropod>=0.1 in the text\n")
    with pytest.warns(plugins.PluginWarning, match=r"neuropod-future 2.0: requires neuropod>=0.9, but this is neuropod 0.4.0"):
        assert [b.platform for b in plugins.installed_backends()] == ["good"]
    (failure,) = plugins.plugin_failures()
    assert (failure.name, failure.distribution, failure.core_range) == ("future", "neuropod-future 2.0", ">=0.9")
    assert "np_test_future" not in sys.modules
    health = {h.name: h for h in plugins.plugin_health()}
    assert (health["good"].distribution, health["good"].version, health["good"].core_range) == ("neuropod-good", "1.0", "<0.5,>=0.4")
    assert health["good"].core_ok and health["good"].state == "loaded"
    assert not health["future"].core_ok and health["future"].state.startswith("skipped: requires neuropod>=0.9")

    from neuropod.cli import main

    out = io.StringIO()
    assert main(["backends"], out) == 0
    lines = [" ".join(line.split()) for line in out.getvalue().splitlines()]
    assert "good neuropod-good 1.0 <0.5,>=0.4 yes loaded" in lines
    assert any(line.startswith("future neuropod-future 2.0 >=0.9 NO skipped: requires neuropod>=0.9") for line in lines)


@pytest.mark.parametrize(
    ("requires", "expected"),
    [
        ("Requires-Dist: neuropod>=0.4,<0.5", ">=0.4,<0.5"),
        ("Requires-Dist: neuropod (>=0.4, <0.5)", ">=0.4,<0.5"),
        ("Requires-Dist: neuropod[gpu]~=0.4.0; python_version >= '3.10'", "~=0.4.0"),
        ("Requires-Dist: neuropod>=0.9; extra == 'old'", ""),  # an extra's requirement does not count
        ("Requires-Dist: neuropod-onnx>=0.9", ""),
        ("Requires-Dist: neuropod", ""),
    ],
)
def test_core_range_from_requires_dist(tmp_path: Path, requires: str, expected: str) -> None:
    info = tmp_path / "neuropod_x-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: neuropod-x\nVersion: 1.0\n{requires}\n")
    found = plugins.core_range(importlib_metadata.PathDistribution(info))
    assert found == expected


@pytest.mark.parametrize(
    ("spec", "ok"),
    [(">=0.4,<0.5", True), ("<0.5,>=0.4", True), (">=0.9", False), ("<0.4", False), ("~=0.4.0", True),
     ("==0.4.*", True), ("!=0.4.0", False), ("", True), (None, True), (">=0.4.0rc1", True)],
)  # fmt: skip
def test_core_satisfies(spec: str | None, ok: bool) -> None:
    assert plugins.core_satisfies(spec, "0.4.0") is ok


def test_import_framework_says_what_installs_a_missing_framework() -> None:
    """Run where the module is blocked, as it fails for a user who has not installed it."""
    code = (
        "import sys\n"
        "sys.modules['onnxruntime'] = None\n"
        "sys.modules['_sqlite3'] = None\n"
        "from neuropod.errors import PluginNotInstalledError\n"
        "from neuropod.plugins import import_framework\n"
        "assert import_framework('json', 'onnx', 'x') is sys.modules['json']\n"
        "for module in ('onnxruntime', 'sqlite3'):\n"
        "    try:\n"
        "        import_framework(module, 'onnx', 'create_onnx_neuropod')\n"
        "    except PluginNotInstalledError as e:\n"
        "        print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    missing, broken = done.stdout.splitlines()
    hint = plugins.pip_install(plugins.KNOWN_FRAMEWORKS["onnx"])
    assert missing == f"create_onnx_neuropod needs onnxruntime, which is not installed: {hint}"
    # A module that is there but whose own import fails (here: sqlite3 without its C part) is not "not installed".
    assert broken.startswith("create_onnx_neuropod needs sqlite3, which is installed but failed to import "
                             "(ModuleNotFoundError: import of _sqlite3 halted")  # fmt: skip
    assert broken.endswith(f"reinstall it: {hint}")


def test_install_hints_name_the_checkout_the_core_was_installed_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Our wheels are not on an index yet: from a checkout, a hint names the checkout's folders."""
    record = importlib_metadata.distribution("neuropod").read_text("direct_url.json")
    installed = json.loads(record or "{}")
    if installed.get("url", "").startswith("file:") and "dir_info" in installed:  # pip install ./core, as the tests are
        assert plugins.source_checkout() == Path(__file__).resolve().parents[2]
    (tmp_path / "plugins" / "neuropod-onnx").mkdir(parents=True)
    (tmp_path / "plugins" / "neuropod-onnx" / "pyproject.toml").write_text("")
    (tmp_path / "serving").mkdir()
    (tmp_path / "serving" / "pyproject.toml").write_text("")
    monkeypatch.setattr(plugins.hints, "source_checkout", lambda: tmp_path)
    assert plugins.pip_install("'neuropod-onnx[cpu]' (or 'neuropod-onnx[gpu]' for NVIDIA GPUs)") == (
        f"pip install '{tmp_path}/plugins/neuropod-onnx[cpu]' (or '{tmp_path}/plugins/neuropod-onnx[gpu]' for NVIDIA GPUs)"
    )
    assert plugins.pip_install("'neuropod-serving[client]'") == f"pip install '{tmp_path}/serving[client]'"
    assert plugins.pip_install("neuropod-jax") == "pip install neuropod-jax", "no such folder: the name stays"
    assert plugins.pip_install("torch") == "pip install torch"
    monkeypatch.setattr(plugins.hints, "source_checkout", lambda: None)  # installed from wheels
    assert plugins.pip_install("'neuropod-onnx[cpu]'") == "pip install 'neuropod-onnx[cpu]'"
