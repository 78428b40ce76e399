"""How messages say a count of things, and how text from elsewhere is shown on a terminal."""

from __future__ import annotations

import re
import reprlib
from collections.abc import Iterable, Iterator


def plural(noun: str, count: int) -> str:
    """`noun` as `count` of it reads: 'record' for 1, 'records' otherwise (0 records)."""
    return noun if count == 1 else noun + "s"


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
"""Control characters (a terminal runs ESC sequences: they set its title, clear it, colour what follows), the
bidirectional marks that reorder what is shown after them, and lone surrogates (the bytes of a file name that is not
UTF-8), which a stream that encodes strictly cannot write at all."""


def printable(text: str) -> str:
    """`text` with what would act on a terminal rather than show (`_UNPRINTABLE`) written as Python escapes, so that
    a message quoting a user's file name or record is one line, shown as it is: '\\x1b', '\\n', '\\u202e'."""
    return _UNPRINTABLE.sub(lambda found: repr(found.group())[1:-1], text)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict, _SHORT.maxstring, _SHORT.maxother, _SHORT.maxlong = 2, 4, 4, 80, 80, 60


def shown(value: object) -> str:
    """`value`'s repr, cut short where it is long or deep: a value from a user's file (a YAML list that aliases
    itself a billion times over, a number of 5000 digits) quoted whole took gigabytes, or a screen."""
    return _SHORT.repr(value)


_ACTING = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]|\r(?!\n)")
"""Control characters but the line end (\\n, \\r\\n) and the tab: ESC sequences (which set a terminal's title, write its
clipboard, clear it), a carriage return that writes over the line, the bell."""


def for_terminal(text: str) -> str:
    """A model's text as a terminal is to get it: what would act on the terminal (`_ACTING`) written as Python
    escapes ('\\x1b'), line ends and tabs as they are. A downloaded model may write anything."""
    return _ACTING.sub(lambda found: repr(found.group())[1:-1], text)


def for_terminal_stream(pieces: Iterable[str]) -> Iterator[str]:
    """`for_terminal` over streamed pieces: a carriage return that ends a piece waits for the next one, which may
    begin with the line feed that makes it a line end (a CRLF written as two tokens showed as '\\r')."""
    held = ""
    for piece in pieces:
        text = held + piece
        held = "\r" if text.endswith("\r") else ""
        if text := text.removesuffix(held):
            yield for_terminal(text)
    if held:
        yield for_terminal(held)
