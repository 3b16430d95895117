"""Following the model repository while serving (``neuropod serve --poll-interval``): each poll
loads the versions that are new or changed and unloads those removed, on a thread of its own that
nothing a poll meets can stop; and what a failed load is.

:class:`RepositoryPolling` is a part of :class:`~neuropod_serving.server.lifecycle.ModelLifecycle`
(which loads and unloads the models a poll decides on).
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from typing import TYPE_CHECKING

from neuropod.errors import NeuropodError, PackageError
from neuropod.storage.urls import redact

if TYPE_CHECKING:
    from neuropod_serving.server.lifecycle import Runner
    from neuropod_serving.server.registry import Catalog, ModelRegistry, ModelSettings, ServedModel
    from neuropod_serving.server.served_versions import Found

log = logging.getLogger("neuropod_serving.server")

#: How long the server's shutdown waits for a poll under way (a listing or download of an object
#: store that does not answer) before it leaves without it: the poll's thread is a daemon.
POLL_STOP_S = 2.0


def failed_load(error: BaseException) -> NeuropodError:
    """What a model's load raised, as the failure of that load: a NeuropodError as it is; anything
    else (an exception of the model's code, or its ``SystemExit``: an ``argparse`` call at import)
    as a PackageError naming it. A real interrupt (KeyboardInterrupt on the main thread, where
    signals arrive) is raised again: it stops the server, not a load.

    Its words show every URL redacted (a model's code may name the presigned URL it read its
    weights from): they are logged and listed in the repository index."""
    if isinstance(error, NeuropodError):
        text = str(error)
        shown = redact(text)
        return error if shown == text else PackageError(shown)
    if isinstance(error, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        raise error
    what = f"{type(error).__name__}({redact(str(error))})" if str(error) else type(error).__name__
    if isinstance(error, SystemExit):
        what += ": its code exited while it was imported or loaded (an argparse call at import?)"
    return PackageError(f"loading the model raised {what}")


class RepositoryPolling:
    """The repository poll of a :class:`~neuropod_serving.server.lifecycle.ModelLifecycle`."""

    if TYPE_CHECKING:
        registry: ModelRegistry
        _lock: threading.Lock
        _closing: threading.Event
        _poller: threading.Thread | None
        poll_interval_s: float | None
        _poll_said: dict[str, str]

        def _apply(
            self, name: str, plan: dict[str, Found], catalog: Catalog, settings: ModelSettings | None, *,
            force: bool, removals: bool = True,
        ) -> tuple[list[tuple[ServedModel, Runner | None]], list[str]]: ...  # fmt: skip
        def _failed_all(self, name: str, error: NeuropodError) -> bool: ...
        def _remove(self, name: str, versions: list[str]) -> list[tuple[ServedModel, Runner | None]]: ...
        def _retire(self, retired: list[tuple[ServedModel, Runner | None]], drain_s: float) -> None: ...
        def _notify(self, name: str, served: ServedModel | None) -> None: ...
        def _update_loaded(self) -> None: ...

    def poll(self, drain_s: float = 30.0) -> None:
        """Bring the loaded models in step with the repository as it is now: load the versions
        the policy serves that are new or whose files changed, and unload those removed from it
        (after their requests finish, as :meth:`load`). A version that fails to load is logged
        once, listed with its reason, and tried again only once its files change; it replaces
        nothing. When a repository PATH cannot be listed, nothing is unloaded this time."""
        retired: list[tuple[ServedModel, Runner | None]] = []
        # Listed (and new packages downloaded) before the lock: a slow store holds up no load or unload.
        catalog = self.registry.scan()
        with self._lock:
            if self._closing.is_set():
                return
            removals = not catalog.errors
            if self._said("listing", "; ".join(catalog.errors)):  # once per outage, not once per poll
                for error in catalog.errors:
                    log.warning("polling the model repository: %s; nothing is unloaded until it can be listed",
                                redact(error))  # fmt: skip
            unreadable = {found.where: problem for _, found, problem in catalog.unreadable}
            for name in sorted(set(catalog.models) | set(self.registry.names())):
                if name not in catalog.models:
                    # Its package is there but cannot be read now (a corrupt or half-copied upload
                    # over it): a failed load of it, which replaces nothing, not a removal.
                    broken = _unreadable_now(self._locations(name), unreadable)
                    if broken:
                        self._failed_all(name, PackageError(broken))
                        if self._said(f"model {name}", broken):
                            log.error("model %r: %s; still serving the one loaded before", name, redact(broken))
                        continue
                    if removals:
                        log.info("model %r is no longer in the repository: unloading it", name)
                        retired += self._remove(name, self.registry.versions(name))
                        self._notify(name, None)
                    continue
                try:
                    plan = self.registry.plan(name, catalog)
                except NeuropodError as e:
                    self._failed_all(name, e)
                    if self._said(f"model {name}", str(e)):
                        log.error("model %r: %s", name, redact(str(e)))
                    continue
                self._said(f"model {name}", "")
                done, _ = self._apply(name, plan, catalog, None, force=False, removals=removals)
                retired += done
            self._update_loaded()
        self._retire(retired, drain_s)

    def _locations(self, name: str) -> list[str]:
        """Where the loaded versions of model ``name`` were loaded from."""
        located = (self.registry.loaded(name, v) for v in self.registry.versions(name))
        return [served.where for served in located if served is not None]

    def _said(self, about: str, message: str) -> bool:
        """Whether ``message`` about ``about`` is new since the last poll ("": nothing to say now)."""
        if self._poll_said.get(about, "") == message:
            return False
        self._poll_said[about] = message
        return bool(message)

    def start_polling(self, interval_s: float) -> None:
        """Call :meth:`poll` every ``interval_s`` seconds on a thread of its own, until :meth:`close`.
        Nothing a poll raises stops the next one (a model's code exiting while it loads included)."""
        if interval_s <= 0:
            raise ValueError(f"the poll interval is a number of seconds above 0, not {interval_s}")
        self.poll_interval_s = interval_s

        def run() -> None:
            while not self._closing.wait(interval_s):
                try:
                    self.poll()
                except BaseException as e:  # noqa: BLE001 - nothing a poll meets may stop the next one
                    # Its traceback as text, redacted (a store's exception may name a presigned URL).
                    log.error("polling the model repository failed:\n%s", redact("".join(traceback.format_exception(e))))

        self._poller = threading.Thread(target=run, name="neuropod-repository-poll", daemon=True)
        self._poller.start()

    def _stop_polling(self) -> None:
        """Wait for a poll under way, for up to :data:`POLL_STOP_S` (set ``_closing`` first): a poll
        waiting on a store that does not answer is left to end with the process."""
        poller = self._poller
        if poller is None or poller is threading.current_thread():
            return
        poller.join(POLL_STOP_S)
        if poller.is_alive():
            log.warning("the repository poll under way did not end within %g s (a repository store that does "
                        "not answer?): stopping without it", POLL_STOP_S)  # fmt: skip


def _unreadable_now(locations: list[str], unreadable: dict[str, str]) -> str | None:
    """Why the package a model was loaded from cannot be read now, when it is still there (a URL the
    listing found unreadable; a local file or folder that is no longer a package), else None."""
    for where in locations:
        if where in unreadable:
            return unreadable[where]
        if "://" not in where and os.path.lexists(where):
            return (f"{where} is no longer a Neuropod package (no config.json in it: a corrupt or half-copied "
                    "file?)")  # fmt: skip
    return None


__all__ = ["POLL_STOP_S", "RepositoryPolling", "failed_load"]
