"""How the app ends when its terminal hangs up, or on SIGTERM / SIGHUP: at once, whatever it is doing.

A real hangup (a terminal window closed, `tmux kill-session`) brings SIGHUP and SIGCONT, and from then
on every write to the terminal fails. Textual's Linux driver then gets stuck on its way out: its SIGCONT
handler restarts the application mode (a continue without a stop before it), with a new writer thread
that dies at its first failed write, and the writes that follow fill that thread's bounded queue until
``close`` blocks on it for good. ``Driver`` restarts only after its own stop and drops the output once a
write has failed. What else may hold the process (a worker thread in a call that does not look at its
cancel) is bounded by procs.end_on_stop_signals: the process is gone procs.LAST_RESORT_S after the
signal, the cleanup done.
"""
from __future__ import annotations

import contextlib
import functools

from .. import procs


class _Output:
    """The driver's terminal file, which stops writing once a write has failed: the terminal is gone, and
    what is still queued has nowhere to go (a writer thread that raised would leave its queue full)."""

    def __init__(self, file):
        self._file, self.gone = file, False

    def write(self, text: str) -> None:
        if not self.gone:
            try:
                self._file.write(text)
            except OSError:
                self.gone = True

    def flush(self) -> None:
        if not self.gone:
            try:
                self._file.flush()
            except OSError:
                self.gone = True

    def fileno(self) -> int:
        return self._file.fileno()


@functools.cache
def driver_class(default: type) -> type:
    """The app's driver: Textual's own, with the hangup fixes above where it is the Linux one."""
    try:
        from textual.drivers.linux_driver import LinuxDriver
    except ImportError:  # no termios: not the driver this is about
        return default
    if default is not LinuxDriver:
        return default  # another driver asked for (TEXTUAL_DRIVER): left as it is

    class Driver(LinuxDriver):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._file = _Output(self._file)
            self._stopped_here = False

        def _sigtstp_application(self, *args) -> None:
            self._stopped_here = True
            super()._sigtstp_application(*args)

        def _sigcont_application(self, *args) -> None:
            # a hangup sends SIGCONT too: only a continue after our own stop (Ctrl-Z) takes the screen again
            if self._stopped_here:
                self._stopped_here = False
                super()._sigcont_application(*args)

    return Driver


def quit_on_stop_signals(loop, quit_app, code: int) -> None:
    """SIGTERM and SIGHUP run ``quit_app`` on ``loop``; the process is gone procs.LAST_RESORT_S later,
    its cleanup done, even if something holds it (procs.end_on_stop_signals)."""

    def on_stop() -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the app is ending already
            loop.call_soon_threadsafe(quit_app)

    with contextlib.suppress(ValueError, OSError):  # not the main thread: nothing to install
        procs.end_on_stop_signals(on_stop, code)
