"""What the rows of an Arrow column hold once read out into Python, for the Parquet, Arrow and `datasets` inputs of
`llm.data.readers`: the bytes of text of each row, counted from the column's buffers before any row is read out
(so that a row too large is skipped unread), and the values with JSON text parsed where the column's type says it
is JSON (the `arrow.json` extension type: what `datasets` 5 writes for a `Json` feature, as it does for a
conversation's turns whose keys differ between rows)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

JSON_EXTENSION = "arrow.json"

Decoder = Callable[[Any], Any]


def text_bytes(pa, array) -> list[int]:
    """The bytes of text (strings and binaries, at any depth) each row of `array` holds once read out. Counted from
    offsets and lengths, never by reading values out: a dictionary column stores a string once for every row that
    names it (5 KB of Parquet held 2,000 copies of 50 MB), and so can string views and list views."""
    kind = array.type
    if isinstance(kind, pa.BaseExtensionType):
        return text_bytes(pa, array.storage)
    if pa.types.is_dictionary(kind):
        sizes = text_bytes(pa, array.dictionary)
        return [0 if index is None else sizes[index] for index in array.indices.to_pylist()]
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind):
        return [length or 0 for length in pa.compute.binary_length(array).to_pylist()]
    if pa.types.is_string_view(kind) or pa.types.is_binary_view(kind):
        return _view_lengths(array)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        offsets = array.offsets.to_pylist()
        return _spans(array, text_bytes(pa, array.values), offsets[:-1], offsets[1:])
    if pa.types.is_list_view(kind) or pa.types.is_large_list_view(kind):
        starts = array.offsets.to_pylist()
        return _spans(array, text_bytes(pa, array.values), starts, map(sum, zip(starts, array.sizes.to_pylist())))
    if pa.types.is_fixed_size_list(kind):
        size, first = kind.list_size, array.offset * kind.list_size
        starts = range(first, first + len(array) * size, size)
        return _spans(array, text_bytes(pa, array.values), starts, (start + size for start in starts))
    if pa.types.is_struct(kind):
        return [sum(row) for row in zip(*(text_bytes(pa, field) for field in array.flatten()), strict=True)] \
            if kind.num_fields else [0] * len(array)
    return [0] * len(array)


def _view_lengths(array) -> list[int]:
    """The lengths of a string or binary view array's values: the first 4 bytes (little-endian, as Arrow stores
    them) of each 16-byte view."""
    views = memoryview(array.buffers()[1]).cast("B")
    nulls = array.is_null().to_pylist()
    return [0 if null else int.from_bytes(views[at:at + 4], "little")
            for null, at in zip(nulls, range(array.offset * 16, (array.offset + len(array)) * 16, 16), strict=True)]


def _spans(array, inner: list[int], starts, ends) -> list[int]:
    """Each row's sum of `inner[start:end]` (a list's elements), 0 for a null row (whose span may be anything)."""
    total = [0, *itertools.accumulate(inner)]
    return [0 if null else total[end] - total[start]
            for null, start, end in zip(array.is_null().to_pylist(), starts, ends, strict=True)]


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
    except ValueError as exc:
        raise NotJson(f"{text[:40] + ('...' if len(text) > 40 else '')!r} is not JSON ({exc})") from None


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
