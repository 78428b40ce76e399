"""Reading the files an offline wandb run writes, as wandb's own reader (gone from wandb 0.31) did."""

import struct
from pathlib import Path


def wandb_records(path: Path):
    """The records of a .wandb file (wandb's protobuf `Record`s), read from its LevelDB-log framing (32 KiB blocks,
    7-byte record headers) after a 7-byte file header."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer too small for a header: zero padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield _record(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield _record(pending + chunk)


def _record(payload: bytes):
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415 - wandb is imported only where a test reads its files

    record = wandb_internal_pb2.Record()
    record.ParseFromString(payload)
    return record
