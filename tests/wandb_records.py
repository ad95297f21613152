"""The records of a W&B run file (``run-<id>.wandb``), read for the tests: W&B writes them in
LevelDB's log format (https://github.com/google/leveldb/blob/main/doc/log_format.md) after a
7-byte header (":W&B", 0xBEE1, version 0), each a wandb_internal Record protobuf."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, found, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header: zeros
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        pos += HEADER
        if kind == 0:  # the rest of the block is padding
            pos += left - HEADER
            continue
        chunk, pos = data[pos:pos + length], pos + length
        if kind == FULL:
            found.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            found.append(pending + chunk)
    return found


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    found = []
    for chunk in chunks(path):
        record = pb.Record()
        record.ParseFromString(chunk)
        found.append(record)
    return found


def history(folder: Path) -> tuple[set[str], dict[int, dict[str, str]], set[str]]:
    """Every offline run file under ``folder``: (run ids, {step: {key: json value}}, groups)."""
    ids: set[str] = set()
    groups: set[str] = set()
    steps: dict[int, dict[str, str]] = {}
    for path in sorted(folder.glob("offline-run-*/run-*.wandb")):
        for record in records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                groups.add(record.run.run_group)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json
                         for i in record.history.item}
                steps.setdefault(int(items["_step"]), {}).update(items)
    return ids, steps, groups
