"""Decode and re-encode a metadata file around the library's integrity envelope.

Structured mutations (decode, change one field, re-encode) are only useful if they get past
the metadata's own checksum to the deeper validation, so a mutated document is re-sealed
with the library's encoder (``metadata.pack_document``). Byte-level mutations are never
re-sealed: the checksum must catch them. The oracle opens the envelope itself (format 2:
``MAGIC``, xxh3-128 of the body, the msgpack body), so it does not share the library's
reader.
"""

from __future__ import annotations

import msgpack
import xxhash

from bytecheckpoint.format import metadata as _meta


def body_of(data: bytes) -> bytes:
    """The msgpack body of a metadata file; ValueError when its envelope does not verify."""
    magic = getattr(_meta, "MAGIC", None)
    if magic is None or not data.startswith(magic):
        return data  # format 1: the bare document
    digest, body = data[len(magic):len(magic) + 16], data[len(magic) + 16:]
    if len(digest) != 16 or xxhash.xxh3_128_digest(body) != digest:
        raise ValueError("metadata checksum does not verify")
    return body


def decode_doc(data: bytes) -> dict:
    doc = msgpack.unpackb(body_of(data), raw=False, strict_map_key=False)
    if not isinstance(doc, dict):
        raise ValueError("metadata document is not a map")
    return doc


def encode_doc(doc: dict) -> bytes:
    """Seal ``doc`` as the library would (raises on values msgpack cannot encode)."""
    pack = getattr(_meta, "pack_document", None)
    return pack(doc) if pack is not None else msgpack.packb(doc, use_bin_type=True)
