"""pbin: the packed, memory-mappable token file (format version 2).

One little-endian file per shard::

    offset  size  field
    0       8     magic b"SFTPBIN\\0"
    8       4     uint32 format version (2)
    12      4     uint32 header_nbytes
    16      4     uint32 crc32 of the header bytes (a corrupt header is caught on open)
    20      4     uint32 reserved, 0
    24      H     JSON header, UTF-8 (see below)
    ...           sections, each starting at a multiple of 64 bytes, zero padding between them; the file ends
                  exactly where the last section ends

The header is a JSON object: `format_version`, `byteorder` ("little"), `alignment` (64), `token_dtype`
("uint16" when `vocab_size <= 65536`, else "uint32"), `vocab_size`, `num_docs`, `num_tokens`, `num_loss_tokens`,
`has_spans`, `provenance` (a str -> str dict: source/template/tokenizer hashes, as given to the writer) and
`sections`: a list of `{name, offset, nbytes, dtype, shape, sha256}` with absolute byte offsets.

Sections (N documents, T tokens, S loss spans in total):

    tokens           uint16|uint32 (T,)    all documents' ids, back to back
    doc_offsets      int64   (N + 1,)      doc i is tokens[doc_offsets[i]:doc_offsets[i + 1]]; [0] = 0, [N] = T
    doc_lengths      int32   (N,)          doc_offsets[i + 1] - doc_offsets[i]
    span_offsets     int64   (N + 1,)      only with spans: doc i's spans are spans[span_offsets[i]:span_offsets[i + 1]]
    spans            int32   (S, 2)        only with spans: half-open [start, end) token ranges relative to the doc,
                                           sorted, non-empty, non-touching (the writer merges touching spans)
    source_names     uint8   (B,)          UTF-8 JSON list of distinct source prefixes (`"data.jsonl:"`,
                                           `"data.parquet:record "`): a source string up to its number
    source_name_ids  int32   (N,)          index into source_names
    source_lines     int64   (N,)          the line or record number; -1 when the source string ends in none
    tag_names        uint8   (G,)          only when a document has a tag: UTF-8 JSON list of distinct tags
    tag_ids          int32   (N,)          only with tag_names: index into tag_names, -1 for an untagged document

A document's source string is `f"{prefix}{line}"` (or `prefix` when line is -1), exactly as the writer was given:
`file:line` for JSONL, `file:record N` for a JSON array, Parquet or `datasets` source. Version 1 stored names without
the `:` and knew only `file:line`.
A file written without spans trains every token: readers report one span `[0, L)` per non-empty document.
No pickle anywhere; every section is a plain array that `numpy` views in place over one read-only `mmap`.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from sftflow.tasks.core.atomic import atomic_writer
from sftflow.tasks.data.records import TokenizedDoc

FORMAT_VERSION = 2
MAGIC = b"SFTPBIN\0"
ALIGNMENT = 64
_PREAMBLE = struct.Struct("<8sIIII")  # magic, version, header_nbytes, header_crc32, reserved

_DTYPES = {"uint8": "<u1", "uint16": "<u2", "uint32": "<u4", "int32": "<i4", "int64": "<i8"}
# name -> dtype, for the sections every file has and the optional span sections.
_REQUIRED = {
    "tokens": None,
    "doc_offsets": "int64",
    "doc_lengths": "int32",
    "source_names": "uint8",
    "source_name_ids": "int32",
    "source_lines": "int64",
}
_SPAN_SECTIONS = {"span_offsets": "int64", "spans": "int32"}


class PbinError(ValueError):
    """A pbin file that cannot be read: wrong magic or version, truncated, or corrupt. Not retried (bad input)."""


@dataclass(frozen=True)
class PbinInfo:
    """What `write_pbin` wrote. Field names match the `PbinShard` manifest, so `PbinShard(**asdict(info))` works."""

    path: str
    sha256: str
    format_version: int
    num_docs: int
    num_tokens: int
    num_loss_tokens: int
    vocab_size: int
    token_dtype: str


def token_dtype_for(vocab_size: int) -> str:
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


# --------------------------------------------------------------------------------------------------- writing


def _normalize_spans(docs: Sequence[TokenizedDoc], lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate every doc's spans at once, drop empty spans and merge touching ones.

    Returns CSR `(span_offsets int64 (N + 1,), spans int32 (S, 2))`. Merging keeps one canonical form per mask, so
    content hashes do not depend on how a mask was cut into spans.
    """
    per_doc = []
    for d in docs:
        spans = np.asarray(d.loss_spans_S2)
        if spans.ndim != 2 or spans.shape[1] != 2:
            if spans.size:
                raise ValueError(f"{d.source}: loss_spans_S2 must have shape (S, 2), got {spans.shape}")
            spans = spans.reshape(0, 2)
        per_doc.append(spans)
    counts = np.fromiter((len(s) for s in per_doc), dtype=np.int64, count=len(docs))
    flat = np.concatenate(per_doc).astype(np.int64) if per_doc else np.zeros((0, 2), np.int64)
    doc_of = np.repeat(np.arange(len(docs)), counts)
    starts, ends = flat[:, 0], flat[:, 1]
    bad = np.flatnonzero((starts < 0) | (ends > lengths[doc_of]) | (ends < starts))
    if bad.size:
        i = int(doc_of[bad[0]])
        raise ValueError(
            f"{docs[i].source}: loss_spans_S2 {per_doc[i].tolist()} out of range for a document of "
            f"{int(lengths[i])} tokens"
        )
    nonempty = ends > starts
    starts, ends, doc_of = starts[nonempty], ends[nonempty], doc_of[nonempty]
    same_doc = doc_of[1:] == doc_of[:-1]
    bad = np.flatnonzero(same_doc & (starts[1:] < ends[:-1]))
    if bad.size:
        i = int(doc_of[bad[0]])
        raise ValueError(f"{docs[i].source}: loss_spans_S2 {per_doc[i].tolist()} must be sorted and non-overlapping")
    breaks = ~same_doc | (starts[1:] > ends[:-1])  # a new run starts after each break
    run_start = np.concatenate([[True], breaks]) if len(starts) else np.zeros(0, bool)
    run_end = np.concatenate([breaks, [True]]) if len(starts) else np.zeros(0, bool)
    spans = np.stack([starts[run_start], ends[run_end]], axis=1).astype(np.int32)
    span_offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(np.bincount(doc_of[run_start], minlength=len(docs)), out=span_offsets[1:])
    return span_offsets, spans


# A source ends in its number after `:` (a line) or `:record ` (a record); a number with a leading zero would not
# print back the same, so it stays in the prefix.
_NUMBERED_SOURCE = re.compile(r"(.*:(?:record )?)(0|[1-9][0-9]*)", re.ASCII | re.DOTALL)


def _split_source(source: str) -> tuple[str, int]:
    """(prefix, number) with `prefix + str(number) == source`, or (source, -1) when it ends in no number."""
    match = _NUMBERED_SOURCE.fullmatch(source)
    if match is None:
        return source, -1
    return match.group(1), int(match.group(2))


def _source_sections(docs: Sequence[TokenizedDoc]) -> dict[str, np.ndarray]:
    names: dict[str, int] = {}
    name_ids = np.empty(len(docs), dtype=np.int32)
    lines = np.empty(len(docs), dtype=np.int64)
    for i, d in enumerate(docs):
        name, line = _split_source(d.source)
        name_ids[i] = names.setdefault(name, len(names))
        lines[i] = line
    names_json = json.dumps(list(names), ensure_ascii=False).encode("utf-8")
    return {
        "source_names": np.frombuffer(names_json, dtype=np.uint8),
        "source_name_ids": name_ids,
        "source_lines": lines,
    }


def _tag_sections(docs: Sequence[TokenizedDoc]) -> dict[str, np.ndarray]:
    """The tag sections, or none when no document has a tag (files without tags stay as they were)."""
    if all(d.tag is None for d in docs):
        return {}
    names: dict[str, int] = {}
    ids = np.array([-1 if d.tag is None else names.setdefault(d.tag, len(names)) for d in docs], dtype=np.int32)
    names_json = json.dumps(list(names), ensure_ascii=False).encode("utf-8")
    return {"tag_names": np.frombuffer(names_json, dtype=np.uint8), "tag_ids": ids}


def _check_vocab(tokens: np.ndarray, doc_offsets: np.ndarray, docs: Sequence[TokenizedDoc], vocab_size: int) -> None:
    if tokens.size == 0:
        return
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab_size))
    if bad.size:
        pos = int(bad[0])
        i = int(np.searchsorted(doc_offsets, pos, side="right")) - 1
        raise ValueError(
            f"{docs[i].source}: input_ids[{pos - int(doc_offsets[i])}] = {int(tokens[pos])} is outside the vocabulary "
            f"(vocab_size={vocab_size})"
        )


def _pad(n: int) -> int:
    return -n % ALIGNMENT


def write_pbin(
    path: str | Path,
    docs: Sequence[TokenizedDoc],
    vocab_size: int,
    provenance: dict[str, str],
    with_spans: bool = True,
) -> PbinInfo:
    """Write `docs` to a pbin file atomically (temporary file in the same folder, fsync, rename, fsync folder).

    Token ids must lie in `[0, vocab_size)`; spans must be sorted, non-overlapping and inside their document
    (touching spans are merged, empty ones dropped). `with_spans=False` writes no span sections: every token trains.
    Raises ValueError naming the document's source on bad input.
    """
    path = Path(path)
    token_dtype = token_dtype_for(vocab_size)
    for key, value in provenance.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"{path}: provenance must map str to str, got {key!r}: {value!r}")

    lengths = np.fromiter((len(d.input_ids) for d in docs), dtype=np.int64, count=len(docs))
    doc_offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=doc_offsets[1:])
    if lengths.size and lengths.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{docs[int(lengths.argmax())].source}: document longer than 2**31 - 1 tokens")
    ids_list = [np.asarray(d.input_ids) for d in docs]
    for d, ids in zip(docs, ids_list, strict=True):
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"{d.source}: input_ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    all_ids = np.concatenate(ids_list).astype(np.int64, copy=False) if docs else np.zeros(0, np.int64)
    _check_vocab(all_ids, doc_offsets, docs, vocab_size)

    sections: dict[str, np.ndarray] = {
        "tokens": all_ids.astype(_DTYPES[token_dtype]),
        "doc_offsets": doc_offsets,
        "doc_lengths": lengths.astype(np.int32),
    }
    if with_spans:
        span_offsets, spans = _normalize_spans(docs, lengths)
        sections["span_offsets"] = span_offsets
        sections["spans"] = spans
        num_loss_tokens = int((spans[:, 1].astype(np.int64) - spans[:, 0]).sum())
    else:
        num_loss_tokens = int(lengths.sum())
    sections.update(_source_sections(docs))
    sections.update(_tag_sections(docs))

    table, offset = [], 0
    for name, arr in sections.items():
        arr = np.ascontiguousarray(arr)
        sections[name] = arr
        dtype_name = arr.dtype.name
        assert dtype_name in _DTYPES, dtype_name
        table.append(
            {
                "name": name,
                "offset": offset,  # relative for now; made absolute once the header size is known
                "nbytes": arr.nbytes,
                "dtype": dtype_name,
                "shape": list(arr.shape),
                "sha256": _sha256(arr),
            }
        )
        offset += arr.nbytes + _pad(arr.nbytes)

    header: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "byteorder": "little",
        "alignment": ALIGNMENT,
        "token_dtype": token_dtype,
        "vocab_size": int(vocab_size),
        "num_docs": len(docs),
        "num_tokens": int(doc_offsets[-1]),
        "num_loss_tokens": num_loss_tokens,
        "has_spans": with_spans,
        "provenance": dict(provenance),
        "sections": table,
    }
    # The header holds absolute offsets, which depend on the header size; pad the JSON with spaces to a fixed
    # 64-byte boundary so that one pass is enough.
    base = _header_base(header)
    for entry in table:
        entry["offset"] += base
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (base - _PREAMBLE.size - len(header_bytes))
    assert len(header_bytes) + _PREAMBLE.size == base
    preamble = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header_bytes), zlib.crc32(header_bytes), 0)

    digest = hashlib.sha256()
    with atomic_writer(path) as f:
        _write(f, digest, preamble + header_bytes)
        for k, arr in enumerate(sections.values()):
            _write(f, digest, _bytes(arr))
            if k + 1 < len(sections):  # no trailing padding: the file ends where the last section ends
                _write(f, digest, b"\0" * _pad(arr.nbytes))
    return PbinInfo(
        path=str(path),
        sha256=digest.hexdigest(),
        format_version=FORMAT_VERSION,
        num_docs=len(docs),
        num_tokens=int(doc_offsets[-1]),
        num_loss_tokens=num_loss_tokens,
        vocab_size=int(vocab_size),
        token_dtype=token_dtype,
    )


def _header_base(header: dict[str, Any]) -> int:
    """Byte offset of the first section: preamble + header JSON, rounded up to 64, with room for the offsets."""
    # Offsets grow by at most `base` when made absolute; reserve enough digits by measuring with a large value.
    probe = json.loads(json.dumps(header))
    for entry in probe["sections"]:
        entry["offset"] += 10**15
    n = _PREAMBLE.size + len(json.dumps(probe, separators=(",", ":")).encode("utf-8"))
    return n + _pad(n)


def _write(f: BinaryIO, digest: Any, data: bytes | memoryview) -> None:
    f.write(data)
    digest.update(data)


def _sha256(arr: np.ndarray | memoryview) -> str:
    return hashlib.sha256(_bytes(arr) if isinstance(arr, np.ndarray) else arr).hexdigest()


def _bytes(arr: np.ndarray) -> memoryview:
    """Zero-copy byte view of a C-contiguous array (memoryview.cast refuses zero-size N-d arrays)."""
    return memoryview(arr.reshape(-1).view(np.uint8))


# --------------------------------------------------------------------------------------------------- reading


class PbinFile:
    """Read-only view of a pbin file. O(1) per document; `doc(i)` is a zero-copy view into the mapping.

    Opening validates magic, version, header checksum and that every section lies inside the file (a truncated file
    fails here, naming the path). `verify()` additionally checks each section's sha256 and the arrays' invariants.
    """

    def __init__(self, path: str | Path, verify: bool = False):
        self.path = str(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _PREAMBLE.size:
                raise PbinError(f"{self.path}: truncated pbin file ({size} bytes, smaller than the preamble)")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        self.header = self._read_header()
        self._sections = {s["name"]: s for s in self.header["sections"]}
        self._check_layout()
        self.has_spans: bool = self.header["has_spans"]
        self.num_docs: int = self.header["num_docs"]
        self.num_tokens: int = self.header["num_tokens"]
        self.vocab_size: int = self.header["vocab_size"]
        self.token_dtype: str = self.header["token_dtype"]
        self.provenance: dict[str, str] = self.header["provenance"]
        self._arrays: dict[str, np.ndarray] = {}
        offsets = self.section("doc_offsets")
        if offsets[0] != 0 or offsets[-1] != self.num_tokens:
            raise PbinError(f"{self.path}: corrupt section 'doc_offsets' (does not span [0, {self.num_tokens}])")
        if verify:
            self.verify()

    # ---- header and layout

    def _read_header(self) -> dict[str, Any]:
        magic, version, header_nbytes, crc, _ = _PREAMBLE.unpack_from(self._mm, 0)
        if magic != MAGIC:
            raise PbinError(f"{self.path}: not a pbin file (magic {magic!r}, expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise PbinError(
                f"{self.path}: pbin format version {version} is not supported (this sftflow reads version "
                f"{FORMAT_VERSION}); rebuild the shard with this sftflow"
            )
        end = _PREAMBLE.size + header_nbytes
        if end > self.file_size:
            raise PbinError(f"{self.path}: truncated pbin file (header ends at byte {end}, file has {self.file_size})")
        raw = self._mm[_PREAMBLE.size : end]
        if zlib.crc32(raw) != crc:
            raise PbinError(f"{self.path}: corrupt pbin header (crc32 mismatch)")
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PbinError(f"{self.path}: corrupt pbin header ({e})") from None
        return header

    def _check_layout(self) -> None:
        h = self.header
        for key in ("token_dtype", "vocab_size", "num_docs", "num_tokens", "num_loss_tokens", "has_spans"):
            if key not in h:
                raise PbinError(f"{self.path}: pbin header lacks '{key}'")
        n, t = h["num_docs"], h["num_tokens"]
        expected: dict[str, tuple[str, tuple[int, ...] | None]] = {
            "tokens": (h["token_dtype"], (t,)),
            "doc_offsets": ("int64", (n + 1,)),
            "doc_lengths": ("int32", (n,)),
            "source_names": ("uint8", None),
            "source_name_ids": ("int32", (n,)),
            "source_lines": ("int64", (n,)),
        }
        if h["has_spans"]:
            expected["span_offsets"] = ("int64", (n + 1,))
            expected["spans"] = ("int32", None)
        if "tag_names" in self._sections or "tag_ids" in self._sections:
            expected["tag_names"] = ("uint8", None)
            expected["tag_ids"] = ("int32", (n,))
        for name, (dtype, shape) in expected.items():
            s = self._sections.get(name)
            if s is None:
                raise PbinError(f"{self.path}: pbin file has no '{name}' section")
            if s["dtype"] != dtype or (shape is not None and tuple(s["shape"]) != shape):
                raise PbinError(
                    f"{self.path}: section '{name}' is {s['dtype']}{tuple(s['shape'])}, expected {dtype}{shape or ''}"
                )
        for s in self._sections.values():
            if s["dtype"] not in _DTYPES:
                raise PbinError(f"{self.path}: section '{s['name']}' has unknown dtype {s['dtype']!r}")
            itemsize = np.dtype(_DTYPES[s["dtype"]]).itemsize
            if s["nbytes"] != itemsize * int(np.prod(s["shape"], dtype=np.int64)) or s["offset"] % ALIGNMENT:
                raise PbinError(f"{self.path}: section '{s['name']}' has an inconsistent size or alignment")
            end = s["offset"] + s["nbytes"]
            if end > self.file_size:
                raise PbinError(
                    f"{self.path}: truncated pbin file (section '{s['name']}' ends at byte {end}, "
                    f"file has {self.file_size})"
                )

    def section(self, name: str) -> np.ndarray:
        """A read-only, zero-copy array over one section, mapped on first use."""
        arr = self._arrays.get(name)
        if arr is None:
            s = self._sections[name]
            dtype = np.dtype(_DTYPES[s["dtype"]])
            count = s["nbytes"] // dtype.itemsize
            if count == 0:
                arr = np.zeros(s["shape"], dtype=dtype)
            else:
                arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=s["offset"]).reshape(s["shape"])
            self._arrays[name] = arr
        return arr

    # ---- integrity

    def verify(self) -> None:
        """Check every section's sha256 and the arrays' invariants; raise PbinError naming the bad section."""
        for name, s in self._sections.items():
            view = memoryview(self._mm)[s["offset"] : s["offset"] + s["nbytes"]]
            try:
                ok = _sha256(view) == s["sha256"]
            finally:
                view.release()
            if not ok:
                raise PbinError(f"{self.path}: corrupt section '{name}' (sha256 mismatch)")
        offsets, lengths = self.section("doc_offsets"), self.section("doc_lengths")
        if (np.diff(offsets) != lengths).any():
            raise PbinError(f"{self.path}: corrupt section 'doc_lengths' (disagrees with doc_offsets)")
        tokens = self.section("tokens")
        if tokens.size and int(tokens.max()) >= self.vocab_size:
            raise PbinError(f"{self.path}: corrupt section 'tokens' (id >= vocab_size {self.vocab_size})")
        if self.has_spans:
            span_offsets, spans = self.section("span_offsets"), self.section("spans")
            if span_offsets[0] != 0 or span_offsets[-1] != len(spans) or (np.diff(span_offsets) < 0).any():
                raise PbinError(f"{self.path}: corrupt section 'span_offsets'")
            doc_of_span = np.repeat(np.arange(self.num_docs), np.diff(span_offsets))
            if len(spans) and (
                (spans[:, 0] < 0).any()
                or (spans[:, 1] <= spans[:, 0]).any()
                or (spans[:, 1] > lengths[doc_of_span]).any()
            ):
                raise PbinError(f"{self.path}: corrupt section 'spans' (span outside its document)")
        if self.has_tags:
            ids = self.section("tag_ids")
            if ids.size and (int(ids.min()) < -1 or int(ids.max()) >= len(self.tag_names)):
                raise PbinError(f"{self.path}: corrupt section 'tag_ids' (outside tag_names)")
        if int(self.loss_token_counts.sum()) != self.header["num_loss_tokens"]:
            raise PbinError(f"{self.path}: header num_loss_tokens disagrees with the spans")

    # ---- per-document access

    def __len__(self) -> int:
        return self.num_docs

    def _check_index(self, i: int) -> int:
        if not -self.num_docs <= i < self.num_docs:
            raise IndexError(f"{self.path}: document {i} out of range (file has {self.num_docs})")
        return i % self.num_docs if self.num_docs else i

    def doc(self, i: int) -> np.ndarray:
        """Token ids of document `i`: a read-only zero-copy view (uint16 or uint32)."""
        i = self._check_index(i)
        offsets = self.section("doc_offsets")
        return self.section("tokens")[int(offsets[i]) : int(offsets[i + 1])]

    def loss_spans(self, i: int) -> np.ndarray:
        """Half-open trained token ranges of document `i`, int32 (S, 2); `[[0, L]]` in a file without spans."""
        i = self._check_index(i)
        if not self.has_spans:
            length = int(self.section("doc_lengths")[i])
            return np.array([[0, length]] if length else np.zeros((0, 2)), dtype=np.int32).reshape(-1, 2)
        span_offsets = self.section("span_offsets")
        return self.section("spans")[int(span_offsets[i]) : int(span_offsets[i + 1])]

    def loss_mask(self, i: int) -> np.ndarray:
        """uint8 mask over document `i`'s tokens: 1 where the token is trained."""
        spans = self.loss_spans(i)
        length = int(self.section("doc_lengths")[self._check_index(i)])
        return spans_to_mask(spans, length)

    @cached_property
    def _source_names(self) -> list[str]:
        return json.loads(self.section("source_names").tobytes().decode("utf-8"))

    def source(self, i: int) -> str:
        """Where document `i` came from, as given to the writer (`"path:line"` or `"path:record N"`)."""
        i = self._check_index(i)
        name = self._source_names[int(self.section("source_name_ids")[i])]
        line = int(self.section("source_lines")[i])
        return name if line < 0 else f"{name}{line}"

    @property
    def has_tags(self) -> bool:
        return "tag_names" in self._sections

    @cached_property
    def tag_names(self) -> list[str]:
        """The distinct tags of the file's documents (empty when none has one)."""
        return json.loads(self.section("tag_names").tobytes().decode("utf-8")) if self.has_tags else []

    @property
    def tag_ids(self) -> np.ndarray:
        """int32 (N,): each document's position in `tag_names`, -1 for an untagged one (all -1 without tags)."""
        return self.section("tag_ids") if self.has_tags else np.full(self.num_docs, -1, dtype=np.int32)

    def tag(self, i: int) -> str | None:
        """Document `i`'s tag, or None."""
        k = int(self.tag_ids[self._check_index(i)])
        return None if k < 0 else self.tag_names[k]

    # ---- per-file arrays

    @property
    def doc_lengths(self) -> np.ndarray:
        """int32 (N,) tokens per document (zero-copy)."""
        return self.section("doc_lengths")

    @cached_property
    def loss_token_counts(self) -> np.ndarray:
        """int64 (N,) trained tokens per document, computed from the spans in one vectorised pass."""
        if not self.has_spans:
            return self.doc_lengths.astype(np.int64)
        spans = self.section("spans")
        cum = np.zeros(len(spans) + 1, dtype=np.int64)
        np.cumsum(spans[:, 1].astype(np.int64) - spans[:, 0], out=cum[1:])
        span_offsets = self.section("span_offsets")
        return cum[span_offsets[1:]] - cum[span_offsets[:-1]]

    def close(self) -> None:
        """Drop the arrays and unmap. Views handed out earlier keep the mapping alive until they are collected."""
        self._arrays.clear()
        self.__dict__.pop("loss_token_counts", None)
        self.__dict__.pop("tag_names", None)
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping is released with it

    def __enter__(self) -> PbinFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PbinFile({self.path!r}, num_docs={self.num_docs}, num_tokens={self.num_tokens})"


def spans_to_mask(spans: np.ndarray, length: int) -> np.ndarray:
    """uint8 (length,) mask with 1 inside the half-open spans (sorted, disjoint)."""
    delta = np.zeros(length + 1, dtype=np.int32)
    if len(spans):
        np.add.at(delta, spans[:, 0], 1)
        np.add.at(delta, spans[:, 1], -1)
    return np.cumsum(delta[:-1], dtype=np.int32).astype(np.uint8)


def open_pbin(path: str | Path, verify: bool = False) -> PbinFile:
    return PbinFile(path, verify=verify)
