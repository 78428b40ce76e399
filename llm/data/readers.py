"""Users' files -> raw values, read in bounded memory.

Text formats: `.txt` (documents separated by blank lines), `.jsonl` (one JSON value per line) and `.json` (an array
of values, or one value), each optionally compressed with gzip, bzip2, xz or Zstandard (`.jsonl.gz`, `.txt.bz2`,
`.json.xz`, `.jsonl.zst`: the Pile's and RedPajama's shards; Zstandard through pyarrow). A leading UTF-8 BOM
is dropped and CRLF line ends become LF. Table formats: Parquet (`.parquet`), Arrow (`.arrow`, IPC file or stream)
and directories written by Hugging Face `datasets`' `save_to_disk` (a Dataset, or a DatasetDict whose splits are
read in order); a row is a record of column -> value. They need the optional `datasets` package (which brings
`pyarrow`); without it such an input is a one-line error saying what to install.

Every value carries its place, `file:line` for text formats and `file:row N` for tables. A value that cannot be
used comes out as `Skipped`, never dropped silently. A file that cannot be read at all (missing, binary, not
UTF-8, invalid `.json`, unknown format) raises `UserError` naming it.

Memory: no file is read whole. A `.txt` document of any length comes out in pieces of at most `PIECE_CHARS`
characters (`Item.last` is False until its final piece), cut before whitespace where possible, where the
tokenizer's pre-tokenizer cuts anyway, so the pieces tokenize exactly as the whole would. A JSON record longer
than its `RecordLimit` is skipped (`.jsonl`) or refused (`.json`) without being held in memory.
"""

from __future__ import annotations

import bz2
import codecs
import errno
import gzip
import io
import json
import lzma
import os
import re
import sys
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from llm.data.arrow_values import NotJson, row_decoder, text_bytes
from llm.errors import UserError
from llm.jsonl import JSON_ERRORS, json_problem
from llm.rundir import broken_link, zerollm_entries
from llm.wording import printable

TEXT_SUFFIXES = (".txt", ".jsonl", ".json")
TABLE_SUFFIXES = (".parquet", ".arrow")
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
FORMATS_SAID = (f"{', '.join(TEXT_SUFFIXES)} (each optionally {', '.join(COMPRESSIONS[:-1])} or {COMPRESSIONS[-1]}), "
                f"{', '.join(TABLE_SUFFIXES)}")
HF_DATASET_FILES = ("state.json", "dataset_info.json")
HF_DATASET_DICT_FILE = "dataset_dict.json"

PIECE_CHARS = 1 << 15
"""Longest piece of text handed to the tokenizer at once. Small pieces tokenize fastest (the `tokenizers` library
holds about 170 bytes per character of one `encode` call), so a long document is cut into pieces of this size."""
DEFAULT_MAX_RECORD_MB = 64.0
ROWS_PER_BATCH = 256
TABLE_ERRORS = (OSError, ValueError, KeyError, TypeError, NotImplementedError, MemoryError)
"""What pyarrow and datasets raise for a damaged or foreign file (their Arrow* errors derive from these)."""
INSTALL_DATASETS = "`pip install 'datasets>=2.19'` (zerollm's `datasets` extra)"


@dataclass(frozen=True)
class Item:
    """One raw value read from a file: a text (str) or a parsed JSON value or table row.

    A long text document comes as several items with the same place: pieces 0, 1, ... of which only the
    last has `last` True.
    """

    source: str
    line: int
    value: Any
    unit: str = "line"
    """'line' (text formats) or 'row' (tables): how `line` counts."""
    piece: int = 0
    last: bool = True

    @property
    def place(self) -> str:
        return place(self.source, self.line, self.unit)


@dataclass(frozen=True)
class Skipped:
    """A record that cannot be used, with its place and the reason."""

    source: str
    line: int
    reason: str
    unit: str = "line"

    def __str__(self) -> str:
        return printable(f"{place(self.source, self.line, self.unit)}: {self.reason}")


def skipped_note(skipped: Sequence[Skipped | str], count: int | None = None) -> str:
    """' (N records skipped, first: FILE:LINE: reason)' for an error that nothing usable was read; '' if none was
    skipped. `count`: how many were, where `skipped` names only the first of them."""
    return f" ({len(skipped) if count is None else count} records skipped, first: {skipped[0]})" if skipped else ""


def place(source: str, line: int, unit: str) -> str:
    """`file:line` for text formats, `file:row N` for tables."""
    return f"{source}:{line}" if unit == "line" else f"{source}:{unit} {line}"


# ---- which files ------------------------------------------------------------------------------------

def _format(path: Path) -> str | None:
    """'.txt', '.jsonl', '.json', '.parquet', '.arrow' or 'hf' (a save_to_disk directory), compression aside; None
    if unknown."""
    if path.is_dir():
        return "hf" if all((path / name).is_file() for name in HF_DATASET_FILES) else None
    name = path.name.lower()
    if compression := _compression(path):
        name, candidates = name.removesuffix(compression), TEXT_SUFFIXES
    else:
        candidates = (*TEXT_SUFFIXES, *TABLE_SUFFIXES)
    return next((suffix for suffix in candidates if name.endswith(suffix)), None)


def _compression(path: Path) -> str | None:
    """The compression suffix of a file's name (one of COMPRESSIONS), or None."""
    return next((suffix for suffix in COMPRESSIONS if path.name.lower().endswith(suffix)), None)


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _dataset_dict_splits(path: Path) -> list[Path]:
    try:
        splits = json.loads((path / HF_DATASET_DICT_FILE).read_text(encoding="utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path / HF_DATASET_DICT_FILE}: not a datasets DatasetDict description ({exc})") from None
    for split in splits:
        if not _a_name_in(split, path):  # '../x' or an absolute path: data outside the folder given was read
            raise UserError(f"{path / HF_DATASET_DICT_FILE}: the split {json.dumps(split)[:80]} is not a folder name "
                            f"in {path}; save the dataset again (datasets names its splits' folders so)")
        if not (path / split).is_dir():  # was 'cannot read (it is a directory now)', of a folder that is not there
            raise UserError(f"{path / split}: no such folder, though {path / HF_DATASET_DICT_FILE} lists the split "
                            f"'{split}'; save the dataset again, or give the splits' folders that are there")
    return [path / split for split in splits]


def _walk(folder: Path, exclude: Path | None) -> tuple[list[Path], dict[Path, int]]:
    """Supported files and save_to_disk datasets under `folder`, sorted, a DatasetDict's splits at its folder's
    place in the order its dataset_dict.json lists them (as when the DatasetDict is named: sorted, the same data
    came out in another order); hidden entries, `exclude`, what zerollm wrote into a run directory or prepared data
    folder (`zerollm_entries`) and anything but regular files (a FIFO would block the reader forever) left out.
    Symlinked folders are followed, each folder read once however many links reach it (so a link loop ends). And
    the symbolic links under `folder` that lead out of it, each with the number of inputs found through it."""
    found: list[tuple[Path, int, Path]] = []
    """Each input found, behind where it sorts: its own path, or its DatasetDict's folder and its split's index."""
    real_folder = folder.resolve()
    seen = {real_folder}
    through: dict[Path, Path | None] = {folder: None}
    """Each folder walked: the link out of `folder` it was reached through, None where none."""
    links_out: dict[Path, int] = {}

    def leading_out(path: Path, real: Path | None = None) -> Path | None:
        """`path` where it is a link out of `folder` (`real`: where it leads, where known)."""
        return path if path.is_symlink() and not _is_within(real or path.resolve(), real_folder) else None

    def take(path: Path, link: Path | None, real: Path | None = None, dataset_dict: Path | None = None,
             split: int = 0) -> None:
        found.append((dataset_dict or path, split, path))
        if (link := link or leading_out(path, real)) is not None:
            links_out[link] = links_out.get(link, 0) + 1

    for root, dirs, files in os.walk(folder, followlinks=True):
        here = Path(root)
        link = through[here]
        own = zerollm_entries(here)
        kept = []
        for name in sorted(dirs):
            sub = here / name
            real = sub.resolve()
            if name.startswith(".") or name in own or real in seen or (exclude is not None and
                                                                       _is_within(real, exclude)):
                continue
            seen.add(real)
            if _format(sub) == "hf":
                take(sub, link, real)
            elif (sub / HF_DATASET_DICT_FILE).is_file():
                for index, split in enumerate(_dataset_dict_splits(sub)):
                    take(split, link or leading_out(sub, real), dataset_dict=sub, split=index)
            else:
                kept.append(name)
                through[sub] = link or leading_out(sub, real)
        dirs[:] = kept
        for name in files:
            if not name.startswith(".") and name not in own and _format(here / name) and (here / name).is_file():
                take(here / name, link)
    return [path for *_, path in sorted(found)], links_out


def _note_links_out(folder: Path, links: dict[Path, int]) -> None:
    """Say which inputs found in `folder` were read through symbolic links that lead out of it (`_walk`): they are
    followed (corpora on other disks are linked in so), but a folder from elsewhere holding a link to your home
    would pull your own files into the data, named only by the link's path in the report."""
    if links:
        shown = ", ".join(f"{printable(str(link))} -> {printable(str(link.resolve()))} ({count} "
                          f"{'input' if count == 1 else 'inputs'})" for link, count in sorted(links.items())[:3])
        more = f" and {len(links) - 3} more" if len(links) > 3 else ""
        print(f"zerollm: note: {printable(str(folder))}: read through symbolic links that lead out of it: {shown}"
              f"{more}; remove a link to leave what it leads to out", file=sys.stderr, flush=True)


def _once(paths: list[Path]) -> list[Path]:
    """`paths` without repeats of a file (by resolved path), in order: one named twice, or named and also found in
    a folder given, is read once."""
    seen: set[Path] = set()
    unique = []
    for path in paths:
        real = path.resolve()
        if real not in seen:
            seen.add(real)
            unique.append(path)
    return unique


def _resolved_out(out: Path) -> Path:
    """`out` resolved; a symbolic-link loop is one line (pathlib's RuntimeError, a traceback, before Python 3.13;
    ELOOP from it on)."""
    try:
        return out.resolve(strict=True)
    except RuntimeError:
        pass
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # a folder still to make (FileNotFoundError): the output checks come later
            return out.resolve()
    raise UserError(f"--out {out}: a symbolic link that leads back to itself; remove the link or give a directory")


def expand_inputs(paths: Iterable[str | Path], exclude: str | Path | None = None,
                  note_links_out: bool = False) -> list[Path]:
    """Files (and save_to_disk datasets) named directly, plus the supported ones under any directory (sorted;
    hidden files and folders are left out), each once. `exclude` (the output directory) is never read: a directory
    walk leaves it out, and naming a path inside it is refused. `note_links_out`: name the symbolic links a folder's
    inputs were read through out of it (`_note_links_out`), for the commands that turn them into data."""
    excluded = _resolved_out(Path(exclude)) if exclude is not None else None
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if excluded is not None and path.exists() and _is_within(path.resolve(), excluded):
            if excluded.is_file():  # this input itself: 'is inside the output directory same.txt'
                raise UserError(f"--out {exclude} is a file, an input of this run; give a directory")
            raise UserError(f"{path}: is inside the output directory {exclude}, which is replaced by this run; "
                            "move the input or choose another --out")
        if (path / HF_DATASET_DICT_FILE).is_file():
            files.extend(_dataset_dict_splits(path))
        elif path.is_dir() and _format(path) != "hf":
            found, links_out = _walk(path, excluded)
            if not found:
                own = " besides what zerollm wrote there, which is not data" if zerollm_entries(path) else ""
                raise UserError(f"{path}: directory holds no {FORMATS_SAID} files or datasets directories{own}")
            if note_links_out:
                _note_links_out(path, links_out)
            files.extend(found)
        elif path.exists():
            if not (path.is_file() or path.is_dir()):
                raise UserError(f"{path}: not a regular file (a FIFO, socket or device); give a file or a directory")
            if _format(path) is None:
                raise UserError(f"{path}: unknown format '{''.join(path.suffixes) or path.name}'; expected one of "
                                f"{FORMATS_SAID} or a directory saved by datasets' save_to_disk")
            files.append(path)
        elif path.is_symlink():
            raise UserError(broken_link(path))
        else:
            raise UserError(f"{path}: no such file or directory")
    if not files:
        raise UserError("no input files given")
    files = _once(files)
    for path in files:
        if _format(path) in TEXT_SUFFIXES:
            _check_text_file(path)
        elif _format(path) in TABLE_SUFFIXES:
            _check_table_file(path)
    return files


def _open(path: Path) -> BinaryIO:
    """The file for reading, decompressed; UserError naming it when it cannot be opened (gone since it was listed,
    say)."""
    try:
        match _compression(path):
            case ".gz":
                return gzip.open(path, "rb")
            case ".bz2":
                return bz2.open(path, "rb")
            case ".xz":
                return lzma.open(path, "rb")
            case ".zst":  # not in Python 3.11's standard library; pyarrow, which Parquet needs, has it
                stream = _pyarrow(path, "Zstandard-compressed").input_stream(str(path), compression="zstd")
                return io.BufferedReader(stream)  # for readline(size), which pyarrow's stream has not
        return path.open("rb")
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror or exc})") from None


WIDE_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
             (codecs.BOM_UTF16_BE, "UTF-16"))
"""Byte-order marks of text in other Unicode encodings (UTF-32 LE's begins with UTF-16 LE's: it comes first)."""


READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)
"""What reading a file can raise: a damaged compressed file raises each (a truncated .gz EOFError, a flipped byte
zlib.error, a damaged .xz LZMAError, a damaged .bz2 or .zst OSError)."""
BINARY = "looks like a binary file (NUL bytes); expected UTF-8 text"


def _check_text_file(path: Path) -> None:
    try:
        with _open(path) as f:
            head = f.read(8192)
    except READ_ERRORS as exc:
        raise UserError(f"{path}: cannot read ({exc})") from None
    for bom, encoding in WIDE_BOMS:
        if head.startswith(bom):
            raise UserError(f"{path}: looks like {encoding} text (byte-order mark {bom.hex(' ').upper()}); convert it "
                            f"to UTF-8 (e.g. iconv -f {encoding} -t UTF-8)")
    if b"\x00" in head:
        raise UserError(f"{path}: {BINARY}")


def _check_table_file(path: Path) -> None:
    """Read a Parquet or Arrow file's schema, so a damaged one is refused before anything is written."""
    pa = _pyarrow(path)
    try:
        if _format(path) == ".parquet":
            pa.parquet.read_schema(path)
        else:
            next(_arrow_batches(pa, path), None)
    except TABLE_ERRORS as exc:
        raise UserError(f"{path}: cannot read it as {_format(path)[1:].capitalize()} "
                        f"({type(exc).__name__}: {exc})") from None


# ---- text formats -----------------------------------------------------------------------------------

def _line_parts(path: Path, max_bytes: int) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, complete) for each line of a text file, decoded, with CRLF made LF and a leading BOM
    dropped. A line longer than `max_bytes` comes in several parts, `complete` only on its last."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    number, carry, first, open_line = 1, "", True, False
    with _open(path) as f:
        while True:
            try:
                raw = f.readline(max_bytes)
                text = carry + decoder.decode(raw, final=not raw)
            except UnicodeDecodeError:
                raise UserError(f"{path}:{number}: not valid UTF-8 text") from None
            except READ_ERRORS as exc:  # a damaged compressed file
                raise UserError(f"{path}:{number}: cannot read ({exc})") from None
            if "\x00" in text:  # past the head `_check_text_file` reads
                raise UserError(f"{path}:{number}: {BINARY}")
            if not raw:
                if text or open_line:
                    yield number, text, True
                return
            if first:
                text, first = text.removeprefix("\ufeff"), False
            complete = raw.endswith(b"\n") or len(raw) < max_bytes
            carry = ""
            if text.endswith("\r\n"):
                text = text[:-2] + "\n"
            elif text.endswith("\r") and not complete:  # maybe the first half of a CRLF
                text, carry = text[:-1], "\r"
            if text or complete:
                yield number, text, complete
            number, open_line = number + complete, not complete


_BEFORE_SPACE = re.compile(r".*\S(?=[ \t\n])", re.DOTALL)
_BEFORE_WORD = re.compile(r".*(?:[^\s\w']|_)(?=[^\W_])", re.DOTALL)


def cut_point(text: str, start: int, limit: int) -> int:
    """Where to cut `text[start:]` (longer than `limit`) so that both halves tokenize as the whole does: the last
    place in the second half of the limit between a non-space and a space, else between punctuation and a letter or
    digit (both boundaries of the byte-level BPE pre-tokenizer); else at the limit. A position in `text`."""
    for pattern in (_BEFORE_SPACE, _BEFORE_WORD):
        match = pattern.match(text, start + limit // 2, start + limit + 1)
        if match:
            return match.end()
    return start + limit


class _Pieces:
    """Collects one document's text and hands it out in pieces of at most `limit` characters; with `strip`, the
    document's trailing line ends go (a .txt block's: the lines' own ends, not the document's text)."""

    def __init__(self, source: str, line: int, limit: int, unit: str = "line", strip: bool = False) -> None:
        self.source, self.line, self.limit, self.unit, self.strip = source, line, limit, unit, strip
        self.parts: list[str] = []
        self.size = self.count = 0

    def add(self, text: str) -> Iterator[Item]:
        self.parts.append(text)
        self.size += len(text)
        if self.size > self.limit:
            buffer, start = "".join(self.parts), 0
            while len(buffer) - start > self.limit:  # pieces are sliced from the whole: cutting the rest off at
                cut = cut_point(buffer, start, self.limit)  # each piece copied it (a 32M-character record: 35 s)
                yield self._item(buffer[start:cut], last=False)
                start = cut
            self.parts = [buffer[start:]]
            self.size = len(self.parts[0])

    def finish(self) -> Iterator[Item]:
        text = "".join(self.parts)
        yield self._item(text.rstrip("\n") if self.strip else text, last=True)

    def _item(self, text: str, last: bool) -> Item:
        self.count += 1
        return Item(self.source, self.line, text, self.unit, piece=self.count - 1, last=last)


def split_text(item: Item, text: str, limit: int = PIECE_CHARS) -> Iterator[Item]:
    """`text` (the whole document of `item`) as one item, or as pieces of at most `limit` characters."""
    pieces = _Pieces(item.source, item.line, limit, item.unit)
    yield from pieces.add(text)
    yield from pieces.finish()


_RUNS = re.compile(r"(.)\1*", re.DOTALL)
"""A run of one character."""


def _txt_items(path: Path) -> Iterator[Item]:
    """The documents of a .txt file: blocks of lines between blank ones (white space only, however long: a blank
    line longer than a part, `PIECE_CHARS`, joined the documents around it)."""
    document: _Pieces | None = None
    blank: list[list] | None = []
    """The line so far while it is white space, as runs [character, count] (bounded however long the line); None
    once it is not."""
    for number, text, complete in _line_parts(path, PIECE_CHARS):
        if blank is not None and not text.strip():
            for run in _RUNS.finditer(text):
                if blank and blank[-1][0] == run[1]:
                    blank[-1][1] += len(run[0])
                else:
                    blank.append([run[1], len(run[0])])
            if complete:  # a blank line: the end of a document
                if document is not None:
                    yield from document.finish()
                    document = None
                blank = []
            continue
        if document is None:
            document = _Pieces(str(path), number, PIECE_CHARS, strip=True)
        for char, count in blank or ():  # the line's white space before its text, in parts of bounded size
            for start in range(0, count, PIECE_CHARS):
                yield from document.add(char * min(PIECE_CHARS, count - start))
        yield from document.add(text)
        blank = [] if complete else None
    if document is not None:
        yield from document.finish()


@dataclass(frozen=True)
class RecordLimit:
    """The largest record read whole, in millions of characters, and the option that raises it where the command
    has one (data prepare's --max-record-mb). A command without it names the limit alone: its skips advised
    raising an option it does not take."""

    mb: float = DEFAULT_MAX_RECORD_MB
    option: str | None = None

    @property
    def chars(self) -> int:
        return int(self.mb * 1e6)

    def exceeded(self, advice: str = "") -> str:
        """What a record over the limit is over, and what to do about it."""
        if self.option:
            return f"{self.option} {self.mb:g}; raise it" + (f", or {advice}" if advice else "")
        return f"the {self.mb:g} MB limit of one record" + (f"; {advice}" if advice else "")


FIXED_RECORD_LIMIT = RecordLimit()
STREAMED_ADVICE = "put long documents in .txt files, which are streamed"


def _too_long(size: int, limit: RecordLimit) -> str:
    return f"record of {size:,} characters is over {limit.exceeded(STREAMED_ADVICE)}"


JSON_TYPE_NAMES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
                   list: "a list", dict: "an object"}


def json_type(value: object) -> str:
    """What a value read from JSON (or a table) is, in JSON's words ('null', 'a list') for a user's message: Python's
    ('NoneType', 'list') are not theirs."""
    return JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _jsonl_items(path: Path, limit: RecordLimit) -> Iterator[Item | Skipped]:
    max_record_chars = limit.chars
    parts: list[str] = []
    size = 0
    for number, text, complete in _line_parts(path, min(PIECE_CHARS, max_record_chars + 1)):
        size += len(text.removesuffix("\n")) if complete else len(text)  # its line end is no part of the record
        if size <= max_record_chars:
            parts.append(text)
        if not complete:
            continue
        line, too_long = "".join(parts), size > max_record_chars
        parts, size_read, size = [], size, 0
        if too_long:
            yield Skipped(str(path), number, _too_long(size_read, limit))
        elif line.strip():
            try:
                yield Item(str(path), number, json.loads(line))
            except JSON_ERRORS as exc:
                yield Skipped(str(path), number, f"malformed JSON ({json_problem(exc)})")


_JSON_SPACE = re.compile(r"[ \t\r\n]*")


ESCAPE_CHARS = len("\\u0000")
"""The longest escape in a JSON string: the text read so far may end inside one."""


def _mistake_before_the_end(exc: json.JSONDecodeError, end: int) -> bool:
    """Whether `exc` is a mistake in the JSON text, not the end of the text read so far (`end`): more text mends
    only an error at that end (within an escape's length of it) or a string that runs to it (reported where it
    starts). Every error was taken for the end: the window grew over the rest of the file, and a mistake early in a
    large file was reported as 'a value longer than --max-record-mb'."""
    return exc.pos < end - ESCAPE_CHARS and not exc.msg.startswith("Unterminated string")


class _JsonStream:
    """The values of a `.json` file (the elements of a top-level array, or the one value), parsed one at a time
    from a sliding window of the text, so the file is never held whole."""

    def __init__(self, path: Path, limit: RecordLimit) -> None:
        self.path, self.limit = path, limit
        self.parts = (text for _, text, _ in _line_parts(path, PIECE_CHARS))
        self.buffer, self.pos, self.line, self.eof = "", 0, 1, False

    def _more(self) -> bool:
        """Append at least as much text as is unread (amortized linear parsing); False at the end of the file."""
        self.buffer, self.pos = self.buffer[self.pos:], 0
        wanted, added = max(len(self.buffer), 1 << 16), []
        while wanted > 0:
            text = next(self.parts, None)
            if text is None:
                self.eof = True
                break
            added.append(text)
            wanted -= len(text)
        self.buffer += "".join(added)
        return bool(added)

    def _peek(self) -> str:
        """The next non-whitespace character ('' at the end), counting lines."""
        while True:
            end = _JSON_SPACE.match(self.buffer, self.pos).end()
            self.line += self.buffer.count("\n", self.pos, end)
            self.pos = end
            if end < len(self.buffer) or not self._more():
                return self.buffer[self.pos:self.pos + 1]

    def _where(self, pos: int | None = None) -> str:
        """path:line of `pos` (default: the next unread character)."""
        return f"{self.path}:{self.line + self.buffer.count(chr(10), self.pos, pos if pos is not None else self.pos)}"

    def _error(self, message: str, pos: int | None = None) -> UserError:
        """A mistake in the file's JSON or its shape."""
        return UserError(f"{self._where(pos)}: {message}; a .json file must hold one array or object")

    def _check_size(self, end: int) -> None:
        if end - self.pos > self.limit.chars:
            raise UserError(f"{self._where()}: a value longer than "
                            f"{self.limit.exceeded('convert the file to .jsonl')}")

    def _value(self) -> tuple[int, Any]:
        decoder = json.JSONDecoder()
        self._peek()
        while True:
            try:
                value, end = decoder.raw_decode(self.buffer, self.pos)
                if end < len(self.buffer) or self.eof:
                    break
            except json.JSONDecodeError as exc:
                if self.eof or _mistake_before_the_end(exc, len(self.buffer)):
                    raise self._error(f"invalid JSON ({exc.msg})", exc.pos) from None
            except JSON_ERRORS as exc:  # more text cannot mend these
                raise self._error(f"invalid JSON ({json_problem(exc)})") from None
            self._check_size(len(self.buffer))
            self._more()
        self._check_size(end)
        line = self.line
        self.line += self.buffer.count("\n", self.pos, end)
        self.pos = end
        return line, value

    def items(self) -> Iterator[Item]:
        first = self._peek()
        if not first:
            return
        if first != "[":
            yield Item(str(self.path), *self._value())
        else:
            self.pos += 1
            if self._peek() == "]":
                self.pos += 1
            else:
                while True:
                    yield Item(str(self.path), *self._value())
                    separator = self._peek()
                    self.pos += 1
                    if separator == "]":
                        break
                    if separator != ",":
                        found = repr(separator) if separator else "the end"
                        raise self._error(f"expected ',' or ']' between array elements, found {found}")
        if self._peek():
            raise self._error("extra data after the top-level value")


# ---- table formats ----------------------------------------------------------------------------------

def _pyarrow(path: Path, what: str = "Parquet/Arrow"):
    try:
        import pyarrow  # noqa: PLC0415 - optional dependency, imported only for these formats
        import pyarrow.compute  # noqa: PLC0415 - not imported by pyarrow itself
        import pyarrow.ipc  # noqa: PLC0415
        import pyarrow.parquet  # noqa: PLC0415
    except ImportError:
        raise UserError(f"{path}: reading {what} files needs pyarrow; install it with "
                        f"{INSTALL_DATASETS}") from None
    return pyarrow


def _without_nulls(value: Any) -> Any:
    """Table rows hold None for a struct field or column a record did not have; drop them, as JSON would."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


@dataclass(frozen=True)
class _RowSkipped:
    """A table row that cannot be read (its text over the record limit, a JSON column's value not JSON), in its
    place (`_batch_rows`)."""
    reason: str


def _batch_rows(pa, batches: Iterable, limit: RecordLimit) -> Iterator[dict | _RowSkipped]:
    """The rows of record batches, read out a few hundred at a time, or one at a time where they hold more text than
    the record limit together; a row over it alone is skipped (rows read out whole took gigabytes). JSON columns come
    out parsed, as `datasets` reads them (`llm.data.arrow_values`)."""
    max_bytes = limit.chars
    for batch in batches:
        sizes = [sum(row) for row in zip(*(text_bytes(pa, column) for column in batch.columns), strict=True)] \
            if batch.num_columns else [0] * batch.num_rows
        decoded = row_decoder(pa, batch.schema)
        for start in range(0, batch.num_rows, ROWS_PER_BATCH):
            part, part_sizes = batch.slice(start, ROWS_PER_BATCH), sizes[start:start + ROWS_PER_BATCH]
            rows = part.to_pylist() if sum(part_sizes) <= max_bytes else \
                (None if size > max_bytes else part.slice(offset, 1).to_pylist()[0]
                 for offset, size in enumerate(part_sizes))
            for row, size in zip(rows, part_sizes, strict=True):
                if row is None:
                    yield _RowSkipped(f"record of {size:,} bytes of text is over {limit.exceeded()}")
                    continue
                try:
                    yield decoded(row) if decoded else row
                except NotJson as exc:
                    yield _RowSkipped(str(exc))


def _arrow_batches(pa, path: Path) -> Iterator:
    """Record batches of an Arrow IPC file (random access format) or stream (what `datasets` writes)."""
    with pa.memory_map(str(path)) as source:
        try:
            reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid:
            source.seek(0)
            yield from pa.ipc.open_stream(source)
            return
        yield from (reader.get_batch(i) for i in range(reader.num_record_batches))


def _a_name_in(name: Any, folder: Path) -> bool:
    """Whether `name` is the name of an entry of `folder` (not a path reaching elsewhere)."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name


def dataset_files(path: Path) -> list[Path]:
    """The files a save_to_disk folder is read from: its description and the Arrow files its state.json names (not
    the cache files that datasets' `.map()` writes beside them). A name reaching out of the folder ('../x.arrow', an
    absolute path) is refused: `datasets` read that file (another user's data, or any file) as the folder's."""
    try:
        files = json.loads((path / HF_DATASET_FILES[0]).read_text(encoding="utf-8"))["_data_files"]
        names = [entry["filename"] for entry in files]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path / HF_DATASET_FILES[0]}: not a datasets save_to_disk description ({exc})") from None
    for name in names:
        if not _a_name_in(name, path):
            raise UserError(f"{path / HF_DATASET_FILES[0]}: the data file {json.dumps(name)[:80]} is not a file name "
                            f"in {path}; save the dataset again (datasets names its files so)")
    return [path / name for name in (*HF_DATASET_FILES, *names)]


def _hf_rows(path: Path, limit: RecordLimit) -> Iterator[dict | _RowSkipped]:
    try:
        import datasets  # noqa: PLC0415 - optional dependency, imported only for save_to_disk directories
    except ImportError:
        raise UserError(f"{path}: reading a save_to_disk directory needs the datasets package; install it with "
                        f"{INSTALL_DATASETS}") from None
    dataset_files(path)  # refuses data files named outside the folder
    # as stored: an Audio or Image column is not decoded (that needed torchcodec or a readable image, for text never
    # used)
    tables = datasets.load_from_disk(str(path)).with_format("arrow").iter(batch_size=ROWS_PER_BATCH)
    yield from _batch_rows(_pyarrow(path), (batch for table in tables for batch in table.to_batches()), limit)


def _table_items(path: Path, kind: str, limit: RecordLimit) -> Iterator[Item | Skipped]:
    pa = _pyarrow(path) if kind != "hf" else None
    rows = {".parquet": lambda: _batch_rows(pa, pa.parquet.ParquetFile(path).iter_batches(ROWS_PER_BATCH), limit),
            ".arrow": lambda: _batch_rows(pa, _arrow_batches(pa, path), limit),
            "hf": lambda: _hf_rows(path, limit)}[kind]
    number = 0
    try:
        for number, row in enumerate(rows(), start=1):
            if isinstance(row, _RowSkipped):
                yield Skipped(str(path), number, row.reason, unit="row")
            else:
                yield Item(str(path), number, _without_nulls(row), unit="row")
    except UserError:
        raise
    except TABLE_ERRORS as exc:
        what = {".parquet": "Parquet", ".arrow": "Arrow", "hf": "a datasets directory"}[kind]
        raise UserError(f"{path}: cannot read it as {what} after row {number} ({type(exc).__name__}: {exc})") from None


def strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value (dict keys and values, list elements), however deeply nested."""
    pending = [value]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            pending += value.keys()
            pending += value.values()
        elif isinstance(value, (list, tuple)):
            pending += value


_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(items: Iterator[Item | Skipped]) -> Iterator[Item | Skipped]:
    """JSON escapes can spell a lone surrogate (`"\\ud800"`), which no tokenizer or UTF-8 file can hold: such a
    record is skipped. (Text read from files is strict UTF-8 and never holds one.)"""
    for item in items:
        if isinstance(item, Item) and any(_SURROGATE.search(text) for text in strings(item.value)):
            yield Skipped(item.source, item.line, "text is not valid Unicode (a lone surrogate such as \\ud800)",
                          item.unit)
        else:
            yield item


def read_items(path: Path, limit: RecordLimit = FIXED_RECORD_LIMIT) -> Iterator[Item | Skipped]:
    """Raw values of one input (checked by `expand_inputs`), streamed; a value with text that is not valid Unicode
    comes out as `Skipped`."""
    kind = _format(path)
    if kind is None:  # listed as a file, replaced by a folder since
        raise UserError(f"{path}: cannot read (it is a directory now)")
    if kind == ".txt":
        return _txt_items(path)
    if kind == ".jsonl":
        return _valid_unicode(_jsonl_items(path, limit))
    if kind == ".json":
        return _valid_unicode(_JsonStream(path, limit).items())
    return _valid_unicode(_table_items(path, kind, limit))
