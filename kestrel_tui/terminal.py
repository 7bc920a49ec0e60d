"""What the command line's modules (cli.py, commands.py, bench.py) share: the two rich consoles
they print with, the model the options name loaded with a progress bar, and the whole-columns table.

Part of the command line: only those modules import it (tests/test_structure.py checks it).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from .session.inputs import RunConfig, model_from_options
from .model.weights import Model

# Output carries tags, paths and names from outside: never markup, never wrapped
# mid-line (styled parts are rich.text.Text; tables fold their own columns).
console = Console(highlight=False, markup=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False, markup=False, soft_wrap=True)


def load_model(config: RunConfig, progress=None) -> Model:
    """The config's model; a checkpoint shows a progress bar on a terminal (or calls `progress`),
    and what the loader noted (a GGUF tokenizer left unused) goes to stderr as `note:` lines."""
    model = _load_with_bar(config, progress)
    for note in model.notes:
        err_console.print(f"note: {note}")
    return model


def _load_with_bar(config: RunConfig, progress) -> Model:
    if progress is not None or config.model is None or not err_console.is_terminal:
        return model_from_options(config, progress)
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("loading {task.fields[name]}"), BarColumn(), TaskProgressColumn(),
                  TextColumn("{task.fields[line]}"), TimeElapsedColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task("load", total=None, name=Path(config.model).name, line="")

        def show(step) -> None:
            bar.update(task, total=step.bytes_total, completed=step.bytes_read, line=step.line())
        return model_from_options(config, show)


@contextlib.contextmanager
def bytes_bar(label: str, total: int | None) -> Iterator[Callable[[int], None] | None]:
    """A progress bar on stderr over `total` bytes when stderr is a terminal: yields the callback told
    each chunk's bytes, or None (no bar) when stderr is piped."""
    if not err_console.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.fields[name]}", markup=False), BarColumn(), DownloadColumn(), TimeRemainingColumn(), console=err_console,
                  transient=True) as bar:
        task = bar.add_task("read", total=total, name=label)  # a field: outside text is never a format
        yield lambda n: bar.advance(task, n)


def whole_columns_table(title: str | None, columns: list[tuple[str, bool]], rows: list[list]) -> Table:
    """A table whose key and number columns (``whole``) never wrap or truncate; the rest fold.

    Piped output is 80 columns wide: a cut key (``t16_l0_kr…``) is worse than no key.
    """
    table = Table(title=title, title_justify="left")
    for i, (name, whole) in enumerate(columns):
        if whole:
            width = max([len(name), *(Text(r[i]).cell_len if isinstance(r[i], str) else r[i].cell_len
                                      for r in rows)])
            table.add_column(name, no_wrap=True, min_width=width)
        else:
            table.add_column(name, overflow="fold")
    for r in rows:
        table.add_row(*r)
    return table
