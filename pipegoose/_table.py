"""Tables of the command-line tools (``python -m pipegoose.kernels doctor``, ``tools/port.py list``) that stay
readable in narrow terminals.

rich shrinks every column of a table in proportion to fit the width, so below about 130 columns it folded kernel ids,
variable names and states mid-word (``TORCH_CUDA_ARCH…``, ``megatro|n/scale|d_maske…``; walkthroughs of sessions 39
and 41). :func:`print_table` keeps the short columns whole and lets the long ones wrap; where the short columns and
``rest_min`` characters of the others (and each of their words of up to 32 characters) do not fit, it prints a list
instead: the row's head cells, then its other cells indented below them.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

Cell = str | Text
# Words up to this long are kept whole in a table's folding columns; longer ones (a path of a cache or a temporary
# folder) fold anyway, rather than make every narrower terminal print the list.
_WORD_MAX = 32


def terminal_width() -> int | None:
    """The tools' console width: ``COLUMNS`` where it is a positive number, else the terminal's (None: rich asks it),
    else 160 when piped (rich assumes 80, which split kernel names mid-word). ``COLUMNS=0`` made rich print nothing
    (port.py list in session 40, doctor in session 41), so it counts as unset."""
    cols = os.environ.get("COLUMNS", "")
    if cols.isdigit() and int(cols) > 0:
        return int(cols)
    if sys.stdout.isatty():
        try:
            return os.get_terminal_size(sys.stdout.fileno()).columns   # (rich would read COLUMNS=0 again)
        except OSError:
            return None
    return 160


def print_table(console: Console, title: str, header: Sequence[str], rows: Sequence[Sequence[Cell]], *,
                whole: Sequence[int], head: Sequence[int], rest_min: int = 40, show_header: bool = True,
                labels: bool = False) -> None:
    """Print ``rows`` (cells: str, printed as written, or rich Text) under ``title``.

    Args:
        whole: indices of the columns kept unbroken in the table (the others fold).
        head: indices of the cells on a row's first line in the list layout (the other non-empty cells follow,
            joined by "; ", wrapped and indented by 4).
        labels: in the list layout, each of those other cells follows its column's name ("entry symbols: 1/1").
        rest_min: the table is printed where ``whole``'s columns leave at least this many characters to the others,
            and enough for the longest word (of up to ``_WORD_MAX`` characters) of each of them: rich folds a word
            wider than its column.
    """
    cells = [[c if isinstance(c, Text) else Text(c) for c in row] for row in rows]
    lines = [[Text(h) for h in header], *cells]
    widths = {i: max(len(r[i].plain) for r in lines) for i in whole}
    short = sum(w + 3 for w in widths.values()) + 4   # the whole columns, with their padding and rules
    # The other columns: as wide as their text, narrowed widest first, never below their longest word of up to
    # _WORD_MAX characters (rich's own shrinking folded words mid-word: port.py audit at 60 columns, "csrc/kernels" /
    # "/gamma.cu"; longer words fold anyway).
    others = [i for i in range(len(header)) if i not in widths]
    natural = {i: max(len(line) for r in lines for line in r[i].plain.splitlines() or [""]) for i in others}
    floor = {i: max((len(w) for r in lines for w in r[i].plain.split() if len(w) <= _WORD_MAX), default=1)
             for i in others}
    room = console.width - short - 3 * len(others) + 3   # the others' text, less a padding of 2 and a rule each
    if console.width >= short + rest_min and room >= sum(floor.values()):
        while sum(natural.values()) > room:
            i = max((i for i in others if natural[i] > floor[i]), key=lambda i: natural[i])
            natural[i] -= 1
        console.print(Text(title, overflow="fold"), soft_wrap=False)   # (a table's title ignored the width)
        table = Table(show_header=show_header, show_lines=False)
        for i, col in enumerate(header):
            if i in widths:
                table.add_column(col, no_wrap=True, min_width=widths[i])
            else:
                table.add_column(col, overflow="fold", width=natural[i])
        for row in cells:
            table.add_row(*row)
        console.print(table)
        return
    console.print(Text(title, style="bold", overflow="fold"), soft_wrap=False)
    for row in cells:
        first = Text("  ").join(row[i] for i in head)
        first.overflow = "fold"   # (wrapped at its spaces; a word wider than the terminal folds)
        console.print(first, soft_wrap=False)
        rest = "; ".join(f"{header[i]}: {c.plain}" if labels else c.plain
                         for i, c in enumerate(row) if i not in head and c.plain)
        for line in textwrap.wrap(rest, max(console.width - 4, 8), break_on_hyphens=False):
            console.print(Text("    " + line), soft_wrap=True)
