"""What the rows of an Arrow column hold once read out into Python, for the Parquet, Arrow and `datasets` inputs of
`llm.data.readers`: the bytes of text of each row, counted from the column's buffers before any row is read out
(so that a row too large is skipped unread), and the values with JSON text parsed where the column's type says it
is JSON (the `arrow.json` extension type: what `datasets` 5 writes for a `Json` feature, as it does for a
conversation's turns whose keys differ between rows)."""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Callable
from typing import Any

from llm.jsonl import JSON_ERRORS, json_problem

JSON_EXTENSION = "arrow.json"

Decoder = Callable[[Any], Any]


def text_bytes(pa, array) -> list[int]:
    """The bytes of text (strings and binaries, at any depth) each row of `array` holds once read out. Counted from
    offsets and lengths, never by reading values out: a dictionary column stores a string once for every row that
    names it (5 KB of Parquet held 2,000 copies of 50 MB), and so can string views, list views, run-end encoded
    columns and unions. A child is counted over the part the rows use (a slice's child is its whole column's)."""
    kind = array.type
    if isinstance(kind, pa.BaseExtensionType):
        return text_bytes(pa, array.storage)
    if pa.types.is_dictionary(kind):
        return _picked(text_bytes(pa, array.dictionary), array.indices.to_pylist())
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind):
        return [length or 0 for length in pa.compute.binary_length(array).to_pylist()]
    if pa.types.is_string_view(kind) or pa.types.is_binary_view(kind):
        return _view_lengths(array)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        offsets = array.offsets.to_pylist()
        return _spans(pa, array, offsets[:-1], offsets[1:])
    if pa.types.is_list_view(kind) or pa.types.is_large_list_view(kind):
        starts = array.offsets.to_pylist()
        return _spans(pa, array, starts, [start + size for start, size in zip(starts, array.sizes.to_pylist(),
                                                                              strict=True)])
    if pa.types.is_fixed_size_list(kind):
        first = array.offset * kind.list_size
        starts = list(range(first, first + len(array) * kind.list_size, kind.list_size))
        return _spans(pa, array, starts, [start + kind.list_size for start in starts])
    if pa.types.is_struct(kind):
        return [sum(row) for row in zip(*(text_bytes(pa, field) for field in array.flatten()), strict=True)] \
            if kind.num_fields else [0] * len(array)
    if pa.types.is_run_end_encoded(kind):
        return _run_end_bytes(pa, array)
    if pa.types.is_union(kind):
        return _union_bytes(pa, array)
    return [0] * len(array)


def _picked(sizes: list[int], indices: list[int | None]) -> list[int]:
    return [0 if index is None else sizes[index] for index in indices]


def _int32(buffer: memoryview, at: int) -> int:
    """The int32 at byte `at` of an Arrow buffer (little-endian, as Arrow stores them)."""
    return int.from_bytes(buffer[at:at + 4], "little", signed=True)


def _view_lengths(array) -> list[int]:
    """The lengths of a string or binary view array's values: the first 4 bytes of each 16-byte view."""
    views = memoryview(array.buffers()[1]).cast("B")
    nulls = array.is_null().to_pylist()
    return [0 if null else _int32(views, at)
            for null, at in zip(nulls, range(array.offset * 16, (array.offset + len(array)) * 16, 16), strict=True)]


def _spans(pa, array, starts: list[int], ends: list[int]) -> list[int]:
    """Each row's text in the elements `starts[i]:ends[i]` of `array.values`, 0 for a null row (whose span may be
    anything); only the part of the values the rows span is counted."""
    nulls = array.is_null().to_pylist()
    spans = [(start, end) for null, start, end in zip(nulls, starts, ends, strict=True) if not null and end > start]
    if not spans:
        return [0] * len(array)
    low, high = min(start for start, _ in spans), max(end for _, end in spans)
    total = [0, *itertools.accumulate(text_bytes(pa, array.values.slice(low, high - low)))]
    return [0 if null or end <= start else total[end - low] - total[start - low]
            for null, start, end in zip(nulls, starts, ends, strict=True)]


def _run_end_bytes(pa, array) -> list[int]:
    """A run-end encoded array's rows: each the text of the value of the run it falls in."""
    run_ends, values = array.run_ends.to_pylist(), text_bytes(pa, array.values)
    runs = [bisect.bisect_right(run_ends, array.offset + row) for row in range(len(array))]
    return _picked(values, runs)


def _union_bytes(pa, array) -> list[int]:
    """A union's rows: each the text of the child value its type code picks (at its offset in a dense union, at its
    own row in a sparse one, whose `field` is sliced with it). The codes and offsets are read from their buffers
    (int8 and int32): pyarrow's `type_codes` of a slice start at its parent's."""
    buffers, rows = array.buffers(), range(array.offset, array.offset + len(array))
    type_ids = memoryview(buffers[1]).cast("b")
    codes = [type_ids[row] for row in rows]
    child_of = {code: index for index, code in enumerate(array.type.type_codes)}
    children = {code: text_bytes(pa, array.field(child_of[code])) for code in set(codes)}
    if array.type.mode == "dense":
        offsets = memoryview(buffers[2]).cast("B")
        places = [_int32(offsets, row * 4) for row in rows]
    else:
        places = range(len(array))
    return [children[code][place] for code, place in zip(codes, places, strict=True)]


class NotJson(ValueError):
    """A value of a JSON column that is not JSON text."""


def json_decoder(pa, kind) -> Decoder | None:
    """How to parse the JSON text in a value of type `kind` as `to_pylist` reads it out (a string where the type is
    `arrow.json`, at any depth), or None where the type holds none."""
    if isinstance(kind, pa.BaseExtensionType):
        return _parsed if kind.extension_name == JSON_EXTENSION else json_decoder(pa, kind.storage_type)
    if pa.types.is_dictionary(kind):
        return json_decoder(pa, kind.value_type)
    if pa.types.is_map(kind):
        key, item = json_decoder(pa, kind.key_type), json_decoder(pa, kind.item_type)
        return _each(lambda pair: (_or_same(key)(pair[0]), _or_same(item)(pair[1]))) if key or item else None
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_list_view(kind) \
            or pa.types.is_large_list_view(kind) or pa.types.is_fixed_size_list(kind):
        inner = json_decoder(pa, kind.value_type)
        return _each(inner) if inner else None
    if pa.types.is_struct(kind):
        fields = {field.name: decoder for field in kind if (decoder := json_decoder(pa, field.type))}
        return _fields(fields) if fields else None
    return None


def _parsed(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except JSON_ERRORS as exc:
        raise NotJson(f"{text[:40] + ('...' if len(text) > 40 else '')!r} is not JSON ({json_problem(exc)})") from None


def _or_same(decoder: Decoder | None) -> Decoder:
    return decoder or (lambda value: value)


def _each(decoder: Decoder) -> Decoder:
    return lambda values: None if values is None else [decoder(value) for value in values]


def _fields(decoders: dict[str, Decoder]) -> Decoder:
    return lambda row: None if row is None else {name: decoders[name](value) if name in decoders else value
                                                 for name, value in row.items()}


def row_decoder(pa, schema) -> Decoder | None:
    """How to parse the JSON text in a row (a dict of column -> value) of a table with `schema`, or None where no
    column holds any; a value that is not JSON raises NotJson naming its column."""
    columns = {field.name: decoder for field in schema if (decoder := json_decoder(pa, field.type))}
    if not columns:
        return None

    def decoded(row: dict) -> dict:
        for name, decoder in columns.items():
            try:
                row[name] = decoder(row[name])
            except NotJson as exc:
                raise NotJson(f"column {name!r}: {exc}") from None
        return row

    return decoded
