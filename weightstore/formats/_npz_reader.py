"""Reading an npz as hostile input: the central directory parsed by us (members may not overlap,
sizes are checked against the file before anything is allocated), tensors viewed in place,
verified against the manifest's checksums. Many tensors read together (``read_many``) take the
batched path of :mod:`weightstore.formats._npz_together`, which falls back to this one."""

from __future__ import annotations

import functools
import io
import math
import re
import struct
from collections.abc import Mapping

import numpy as np
from isal import isal_zlib

from weightstore.core.limits import MANIFEST_INFLATION, MAX_ARRAY_BYTES, MAX_MANIFEST_BYTES, MAX_NDIM, MAX_NPY_HEADER
from weightstore.core.manifest import (
    Manifest,
    TensorInfo,
    checksum,
    checksum_text,
    crc32,
    dtype_name,
    parse_manifest,
    raw_bytes,
)
from weightstore.errors import ChecksumError, FormatError, KeyNotInStoreError, UnsafeFileError, named, naming
from weightstore.formats import ReaderDefaults, _npz_together, _shuffle_zstd, _zipdir, foreign_keys
from weightstore.formats._foreign import refuse_torch_archive
from weightstore.formats._npz_layout import MANIFEST_MEMBER, Layout, header_text, layout_of
from weightstore.formats._zipdir import (
    EOCD,
    LOCAL,
    LOCAL_SIG,
    STORED,
)
from weightstore.io.source import ByteSource, prefetch_ranges

#: inflate input chunk: isal inflates 1 MB pieces faster than 16 MB ones (2.6 vs 2.9 s CPU per GB here)
_INFLATE_CHUNK = 1 << 20


#: the npy header numpy writes for a text scalar (every manifest's): read without numpy (its
#: ``literal_eval`` of the header took 0.1 ms, an eighth of opening a file of 100 tensors, and
#: a dtype made of it, a few microseconds more); any other header, however like it, goes to
#: numpy, whose reading this gives for these bytes
_TEXT_SCALAR_HEADER = re.compile(rb"\{'descr': '([<>])U([1-9][0-9]{0,8})', 'fortran_order': False, 'shape': \(\), \} *\n")
_NPY_V1 = b"\x93NUMPY\x01\x00"


#: most bytes one inflate call may return: bounds the transient copy beside the output buffer
_INFLATE_PIECE = 4 << 20


class NpzReader(ReaderDefaults):
    """Reads the central directory and manifest at open; each tensor only when asked."""

    def __init__(self, source: ByteSource):
        self._source = source
        self.name = source.name
        self._data_offsets: dict[str, int] = {}
        self._plain_positions: Mapping[str, int] | None = None  # key -> directory position, plain .npy members
        self._infos: dict[str, TensorInfo] = {}  # a file without a manifest: each npy header, once read
        directory, count, cd_offset = self._read_directory()
        # The manifest first, where the writer puts it (last), so that the directory can be
        # checked against the names it lists in one pass: see :meth:`_as_written`.
        manifest_member = _zipdir.last_member(directory, cd_offset, MANIFEST_MEMBER)
        manifest = None
        if manifest_member is not None:
            try:
                manifest = self._read_manifest(manifest_member)
            except FormatError:  # the last entry may only look like the manifest's: the directory decides
                manifest_member = None
        members = (self._as_written(directory, count, manifest_member, manifest)
                   if manifest_member is not None and manifest is not None else None)
        as_written = members is not None
        if members is None:
            with naming(path=self.name):
                members = _zipdir.parse(directory, count, cd_offset)
            found = members.pop(MANIFEST_MEMBER)
            if found != manifest_member:
                self._data_offsets.clear()  # where the last entry pointed may be no member's
                manifest = self._read_manifest(found) if found is not None else None
        self._members = members
        self._manifest = manifest
        self.metadata = manifest.metadata if manifest else {}
        self.created = manifest.created if manifest else ""
        self.has_checksums = manifest is not None
        self._table = manifest.tensors if manifest is not None else None
        self._codecs = manifest.codecs if manifest else {}
        self._in_table_order = as_written  # a key's member is at its manifest row
        if not as_written:
            self._check_members()

    def _as_written(self, directory: bytes, count: int, manifest_member: _zipdir.Member,
                    manifest: Manifest) -> _zipdir.Directory | None:
        """The tensors' members, if the directory is exactly the one the writer writes for
        this manifest: each key's ``.npy`` member in the manifest's order, then the manifest.
        Proved on whole columns (:func:`_zipdir.parse_expected`), so a file of 50,000 tensors
        opens without a Python step per member. ``None`` for any other file."""
        keys = manifest.tensors.key_list()
        if manifest.codecs or count != len(keys) + 1:
            return None
        joined = ".npy".join(keys) + ".npy" if keys else ""
        if not joined.isascii():
            return None
        head = directory[: len(directory) - _zipdir.CENTRAL_SIZE - len(MANIFEST_MEMBER)]
        name_lens = [length + 4 for length in map(len, keys)]  # each name is the key and ".npy"
        members = _zipdir.parse_expected(head, manifest_member.offset, lambda: [key + ".npy" for key in keys],
                                        joined.encode("ascii"), name_lens)
        self._only_npy = members is not None
        return members

    def _check_members(self) -> None:
        """That the members are the manifest's tensors (or, without one, that their names
        are keys), for a directory :meth:`_as_written` did not prove."""
        member_keys = self._keys_of_members(shuffled=self._manifest is not None)
        if self._table is None:
            with naming(path=self.name):
                self._member_of = foreign_keys(member_keys.items(), "member")
            return
        self._member_of = member_keys
        if not _same_keys(self._table.key_list(), member_keys):
            listed, present = set(self._table), set(member_keys)
            raise FormatError(f"manifest and members disagree (listed but absent: {named(sorted(listed - present))}; "
                              f"present but unlisted: {named(sorted(present - listed))})", path=self.name)
        if len(member_keys) != len(self._members):
            raise FormatError(f"two members hold the same tensor (.npy and {_shuffle_zstd.MEMBER_SUFFIX})", path=self.name)

    @functools.cached_property
    def _member_of(self) -> dict[str, str]:
        """Tensor key -> member name; made on first use for a directory :meth:`_as_written`
        proved (each key's member is ``key.npy``), set by :meth:`_check_members` otherwise."""
        return dict(zip(self._table.key_list(), self._members.names, strict=True))  # type: ignore[union-attr]

    def _keys_of_members(self, *, shuffled: bool) -> dict[str, str]:
        """Tensor key -> member name: ``.npy`` members, and ``compress="shuffle"`` ones when a
        manifest can say what they hold. Notes in ``_only_npy`` whether every member is ``.npy``
        (then a key's member is found without a test per key, see :meth:`_plain_positions_of`)."""
        names = list(self._members)
        self._only_npy = ("\0".join(names) + "\0").count(".npy\0") == len(names)  # (names hold no NUL)
        if self._only_npy:
            return dict(zip([name[:-4] for name in names], names, strict=True))
        member_keys = {}
        for name in names:
            if name.endswith(".npy"):
                member_keys[name[:-4]] = name
            elif name.endswith(_shuffle_zstd.MEMBER_SUFFIX) and shuffled:
                member_keys[name[: -len(_shuffle_zstd.MEMBER_SUFFIX)]] = name
            else:
                with naming(path=self.name):
                    refuse_torch_archive(names)
                raise FormatError(f"member {name!r} is not an .npy array", path=self.name)
        return member_keys

    # -- the directory -------------------------------------------------------------------
    def _read_directory(self) -> tuple[bytes, int, int]:
        """The central directory's bytes, its entry count and offset."""
        size = self._source.size
        if size == 0:
            raise FormatError("file is empty", path=self.name)
        # the end record alone where it has no comment (as the writer writes it), else as far
        # back as a comment may reach: 64 KB copied (and mapped page by page) for nothing
        tail_start = size - EOCD.size
        tail = bytes(self._source.read_at(tail_start, EOCD.size)) if tail_start >= 0 else b""
        if not (tail.startswith(_zipdir.EOCD_SIG) and tail.endswith(b"\0\0")):
            tail_start = max(0, size - (EOCD.size + 0xFFFF))
            tail = bytes(self._source.read_at(tail_start, size - tail_start))
        with naming(path=self.name):
            count, cd_size, cd_offset, eocd_offset = _zipdir.locate_zip64(
                lambda offset, length: bytes(self._source.read_at(offset, length)), _zipdir.locate(tail, tail_start))
        if cd_offset + cd_size > eocd_offset or count * _zipdir.CENTRAL_SIZE > cd_size:
            raise FormatError("zip directory points outside the file (truncated?)", path=self.name)
        if cd_offset + cd_size != eocd_offset:  # zipfile would take the gap for a prefix and move every member
            raise FormatError("bytes lie between the zip directory and its end record", path=self.name)
        return bytes(self._source.read_at(cd_offset, cd_size)), count, cd_offset

    # -- members ------------------------------------------------------------------------
    def _data_offset(self, member: _zipdir.Member) -> int:
        cached = self._data_offsets.get(member.name)
        if cached is not None:
            return cached
        # header and name in one read: the directory proved both lie before the next member
        header = bytes(self._source.read_at(member.offset, LOCAL.size + len(member.raw_name)))
        sig, _, _, method, _, _, _, _, _, name_len, extra_len = LOCAL.unpack_from(header)
        if sig != LOCAL_SIG or method != member.method:
            raise FormatError(f"local header of {member.name!r} is corrupt", path=self.name)
        if name_len != len(member.raw_name) or header[LOCAL.size :] != member.raw_name:
            raise UnsafeFileError(f"local header of {member.name!r} names another file", path=self.name)
        start = member.offset + LOCAL.size + name_len + extra_len
        if start + member.compressed > member.limit:
            raise UnsafeFileError(f"member {member.name!r} overlaps the next one (zip bomb?)", path=self.name)
        self._data_offsets[member.name] = start
        return start

    def _member_bytes(self, member: _zipdir.Member, budget: int) -> memoryview:
        """A member's bytes: a view into the map when stored, inflated (and bounded) when not."""
        if member.size > budget:
            raise UnsafeFileError(f"member {member.name!r} is larger than allowed ({member.size} > {budget})", path=self.name)
        prefetch_ranges(self._source, lambda: [self._extent(member)])
        start = self._data_offset(member)
        if member.method == STORED:
            self._source.prefetch(start, member.size)
            return memoryview(self._source.read_at(start, member.size))
        out = bytearray(member.size)
        view = memoryview(out)
        engine = isal_zlib.decompressobj(-15)
        filled = 0
        for chunk_start in range(start, start + member.compressed, _INFLATE_CHUNK):
            chunk = self._source.read_at(chunk_start, min(_INFLATE_CHUNK, start + member.compressed - chunk_start))
            pending = bytes(chunk)
            self._source.release(chunk_start, len(chunk))  # else the compressed pages stay in RSS
            while True:
                # Each piece is capped, so 1 MB of input that inflates to a whole tensor never
                # exists twice (piece + output): the input left over waits in unconsumed_tail,
                # output already inflated inside the engine comes out on the next call (even
                # with no input left). The +1 lets a stream that runs past the declared size show.
                wanted = min(_INFLATE_PIECE, member.size - filled + 1)
                try:
                    piece = engine.decompress(pending, wanted)
                except isal_zlib.error as exc:  # type: ignore[misc]  # isal's stubs do not say it is an exception
                    raise FormatError(f"member {member.name!r} is corrupt (deflate: {exc})", path=self.name) from None
                if filled + len(piece) > member.size:
                    raise FormatError(f"member {member.name!r} inflates past its declared size", path=self.name)
                view[filled : filled + len(piece)] = piece
                filled += len(piece)
                pending = engine.unconsumed_tail
                if engine.eof or (not pending and len(piece) < wanted):
                    break
        if filled != member.size or not engine.eof:
            raise FormatError(f"member {member.name!r} is truncated or corrupt (deflate)", path=self.name)
        return view

    def _extent(self, member: _zipdir.Member) -> tuple[int, int]:
        """The bytes reading a member touches (local header, name, padding, data), within its limit."""
        most = LOCAL.size + len(member.raw_name) + 0xFFFF + member.compressed
        return member.offset, min(member.limit - member.offset, most)

    def prefetch(self, keys: list[str]) -> None:
        """Announce the tensors read next, so a remote source fetches them at once; each is
        bounded first, as a read would be."""
        def extents() -> list[tuple[int, int]]:
            found = []
            for key in keys:
                member = self._member(key)
                if self._manifest is not None:
                    self._listed(key, member)  # a member larger than its manifest entry is refused, not fetched
                found.append(self._extent(member))
            return found

        prefetch_ranges(self._source, extents)

    def _member_head(self, member: _zipdir.Member) -> memoryview:
        """The first bytes of a member, enough for its npy header, without reading or inflating the rest."""
        start = self._data_offset(member)
        wanted = min(member.size, 12 + MAX_NPY_HEADER)
        if member.method == STORED:
            return memoryview(self._source.read_at(start, wanted))
        engine = isal_zlib.decompressobj(-15)
        head = bytearray()
        position, end = start, start + member.compressed
        while len(head) < wanted and position < end and not engine.eof:
            chunk = bytes(self._source.read_at(position, min(1 << 16, end - position)))
            position += len(chunk)
            try:
                head += engine.decompress(chunk, wanted - len(head))
            except isal_zlib.error as exc:  # type: ignore[misc]  # isal's stubs do not say it is an exception
                raise FormatError(f"member {member.name!r} is corrupt (deflate: {exc})", path=self.name) from None
        return memoryview(head)

    def _parse_npy(
        self, member: _zipdir.Member, data: memoryview, size: int | None = None,
    ) -> tuple[np.dtype, tuple[int, ...], bool, int]:
        """Check a member's npy header; ``size`` is the whole member's when ``data`` is only its head.

        numpy parses the header (``read_array_header_1_0``/``_2_0``: the same rules ``np.load``
        applies; a version 3 header is read as version 2, which differs only in decoding bytes
        no plain numeric header holds; the manifest's, as numpy writes it, never comes here:
        :func:`_text_scalar`). Around it, our policy: a bounded header length, read
        only from bytes the member holds; no object or structured dtype; sizes that are no
        bools or negatives; and a shape whose bytes are exactly what the member holds.
        Members of this project's own files never come here but for the manifest:
        :meth:`_check_header` compares their headers byte for byte with the one the manifest
        implies (the fast path; a header is one slice comparison, not a parse).
        """
        what = f"member {member.name!r}"
        size = len(data) if size is None else size
        if len(data) < 10 or bytes(data[:6]) != b"\x93NUMPY":
            raise FormatError(f"{what} is not an npy array", path=self.name)
        major = data[6]
        if major == 1:
            header_len, prefix = struct.unpack("<H", data[8:10])[0], 10
        elif major in (2, 3) and len(data) >= 12:
            header_len, prefix = struct.unpack("<I", data[8:12])[0], 12
        else:
            raise FormatError(f"{what} has unknown npy version {major}", path=self.name)
        if header_len > MAX_NPY_HEADER:
            raise UnsafeFileError(f"{what} has an npy header of {header_len} bytes (limit {MAX_NPY_HEADER})", path=self.name)
        if prefix + header_len > len(data):
            raise FormatError(f"{what} is truncated inside its npy header", path=self.name)
        shape: tuple[int, ...]
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        try:
            shape, fortran, dtype = read_header(io.BytesIO(data[8 : prefix + header_len]), max_header_size=MAX_NPY_HEADER)
        except Exception as exc:  # junk raises ValueError, SyntaxError, tokenize's TokenError, ...
            detail = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
            raise FormatError(f"{what} has an unreadable npy header ({detail})", path=self.name) from None
        if len(shape) > MAX_NDIM or not all(not isinstance(d, bool) and d >= 0 for d in shape):
            raise FormatError(f"{what} has an invalid shape {shape!r}", path=self.name)
        if dtype.hasobject:
            raise UnsafeFileError(f"{what} holds an object array; weightstore never unpickles", path=self.name)
        if dtype.names is not None:
            raise UnsafeFileError(f"{what} holds a structured array; only plain numeric arrays are read", path=self.name)
        if dtype.subdtype is not None or dtype.itemsize == 0:
            raise FormatError(f"{what} has dtype {dtype.str!r}; only plain numeric arrays are read", path=self.name)
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize > MAX_ARRAY_BYTES:
            raise FormatError(f"{what} has a shape {shape} too large for any array", path=self.name)
        expected = math.prod(shape) * dtype.itemsize
        start = prefix + header_len
        if size - start != expected:
            raise FormatError(
                f"{what}: header says {shape} of {dtype} ({expected} bytes) but the member holds {size - start}",
                path=self.name,
            )
        return dtype, shape, fortran, start

    def _read_manifest(self, member: _zipdir.Member) -> Manifest:
        """The manifest, always checked against its zip CRC-32: it decides what every tensor is.

        Weightstore stores it; a deflated one (an archive zipped again) may inflate at most
        :data:`MANIFEST_INFLATION` times: nested JSON in UTF-32 deflates far past that, and at
        deflate's own 1032x a 240 KB member made 0.8 GB of text and objects."""
        if member.method != STORED and member.size > MANIFEST_INFLATION * member.compressed + MAX_NPY_HEADER:
            raise UnsafeFileError(f"manifest member {member.name!r} inflates {member.compressed} bytes to "
                                  f"{member.size} (at most {MANIFEST_INFLATION}x)", path=self.name)
        data = self._member_bytes(member, 4 * MAX_MANIFEST_BYTES + MAX_NPY_HEADER)
        if isal_zlib.crc32(raw_bytes(data)) & 0xFFFFFFFF != member.crc:
            raise ChecksumError(f"manifest member {member.name!r} is corrupt (zip CRC-32 mismatch)", path=self.name)
        text_at = _text_scalar(data)
        if text_at is None:  # any other header: numpy's reading of it decides
            dtype, shape, _, start = self._parse_npy(member, data)
            if dtype.kind != "U" or shape != ():
                raise FormatError("manifest member is not a text scalar", path=self.name)
            text_at = "utf-32-le" if dtype.byteorder in "<=|" else "utf-32-be", start
        encoding, start = text_at
        text = str(data[start:], encoding, "replace")  # no copy first
        return parse_manifest(text.rstrip("\0"), self.name)

    # -- the Reader protocol -----------------------------------------------------------------
    def keys(self) -> list[str]:
        return self._table.key_list() if self._table is not None else sorted(self._member_of)

    def _member(self, key: str) -> _zipdir.Member:
        name = self._member_of.get(key)
        if name is None:
            raise KeyNotInStoreError("no such tensor", path=self.name, key=key)
        return self._members[name]

    def info(self, key: str) -> TensorInfo:
        if self._table is not None:
            if key not in self._table:
                raise KeyNotInStoreError("no such tensor", path=self.name, key=key)
            return self._table[key]
        info = self._infos.get(key)
        if info is None:
            member = self._member(key)
            self._source.check_unchanged(f"tensor {key!r}")
            dtype, shape, _, _ = self._parse_npy(member, self._member_head(member), member.size)
            name = dtype_name(dtype, key) if dtype.kind != "V" else f"V{dtype.itemsize}"
            info = TensorInfo(key, name, shape, math.prod(shape) * dtype.itemsize, None)
            self._infos[key] = info
        return info

    def _listed(self, key: str, member: _zipdir.Member) -> tuple[TensorInfo, Layout]:
        """A tensor's manifest entry and the exact bytes its member must begin with.

        The member must be that npy header followed by exactly the entry's bytes: refused from
        the sizes alone, before anything is inflated or allocated, so a manifest that lies
        small (to pass ``max_bytes``) cannot front a large member.
        """
        info = self._table[key]  # type: ignore[index]  # only called for files with a manifest
        layout = layout_of(info.dtype, info.shape)
        shuffled = member.name.endswith(_shuffle_zstd.MEMBER_SUFFIX)
        if shuffled != (self._codecs.get(key) == _shuffle_zstd.CODEC):
            raise FormatError(f"is stored as member {member.name!r} but its manifest "
                              f"entry says codec {self._codecs.get(key)!r}", path=self.name, key=key)
        if shuffled:
            if member.method != STORED or member.size > _shuffle_zstd.max_encoded_size(info.nbytes):
                raise UnsafeFileError(f"(member {member.name!r}) holds {member.size} encoded bytes for "
                                      f"{info.nbytes} plain ones; refusing to read it", path=self.name, key=key)
            return info, layout
        if member.size != len(layout.header) + info.nbytes:
            raise UnsafeFileError(
                f"(member {member.name!r}) holds {member.size} bytes but the manifest "
                f"says {info.shape} {info.dtype} ({info.nbytes} bytes after a {len(layout.header)}-byte header); "
                "refusing to read it",
                path=self.name, key=key,
            )
        return info, layout

    def _check_header(self, key: str, info: TensorInfo, layout: Layout, head: memoryview) -> None:
        """Byte for byte, as the writer would have written it: dtype, shape and order all decide what
        the data means, and nothing else checks them (the tensor checksum covers the data only)."""
        found = bytes(head[: len(layout.header)])
        if found != layout.header:
            said, meant = header_text(found), header_text(layout.header)
            what = f"npy header {said}" if said else "a damaged npy header"
            raise FormatError(f"has {what}, where its manifest entry ({info.shape} {info.dtype}) implies {meant}",
                              path=self.name, key=key)

    def extent(self, key: str) -> tuple[int, int]:
        """``(offset, length)`` of a tensor's bytes in the file, after its npy header (a sharded
        version's index records it, and readers of a region fetch byte ranges of it): only a
        plain stored member of a file with a manifest has its bytes as they are in memory."""
        member = self._member(key)
        if self._manifest is None or member.method != STORED or self._codecs.get(key):
            raise FormatError("is compressed or has no manifest entry; its bytes are not a plain range of the file",
                              path=self.name, key=key)
        info, layout = self._listed(key, member)
        return self._data_offset(member) + len(layout.header), info.nbytes

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        return self._read_one(key, verify)

    def read_many(self, keys: list[str], *, verify: bool) -> list[np.ndarray]:
        """Tensors in ``keys``' order: what ``read`` returns for each, but a file of 50,000 small
        tensors costs microseconds per tensor (:func:`weightstore.formats._npz_together.read_many`)."""
        return _npz_together.read_many(self, keys, verify=verify)

    def _read_one(self, key: str, verify: bool) -> np.ndarray:
        member = self._member(key)
        self._source.check_unchanged(f"tensor {key!r}")
        if self._manifest is None:
            return self._read_foreign(key, member, verify)
        info, layout = self._listed(key, member)
        if self._codecs.get(key):
            return self._read_shuffled(key, member, info, layout, verify)
        data = self._member_bytes(member, member.size)
        self._check_header(key, info, layout, data)
        payload = data[len(layout.header) :]
        if verify:
            self._verify(key, member, data, payload, info)
        count = math.prod(info.shape)
        array = np.frombuffer(payload, dtype=layout.storage, count=count) if count else np.empty(0, layout.storage)
        return array.reshape(info.shape).view(layout.logical)

    def _read_shuffled(self, key: str, member: _zipdir.Member, info: TensorInfo, layout: Layout,
                       verify: bool) -> np.ndarray:
        """A ``compress="shuffle"`` tensor, decoded into memory it owns and checked against the
        manifest's CRC-32 of the plain bytes (the zip CRC, of the encoded bytes, is not needed)."""
        plain, crc = _shuffle_zstd.decode(self._member_bytes(member, member.size), layout.storage.itemsize,
                                         info.nbytes, self.name, key)
        self._source.release(self._data_offset(member), member.size)  # else the encoded pages stay in RSS
        if verify and info.checksum and checksum_text(crc) != info.checksum:
            raise ChecksumError(f"is corrupt (checksum {checksum_text(crc)}, "
                                f"manifest {info.checksum})", path=self.name, key=key)
        return plain.view(layout.storage).reshape(info.shape).view(layout.logical)

    def _read_foreign(self, key: str, member: _zipdir.Member, verify: bool) -> np.ndarray:
        """A member of a file without a manifest: its own npy header is all there is to go on."""
        data = self._member_bytes(member, member.size)
        dtype, shape, fortran, start = self._parse_npy(member, data)
        payload = data[start:]
        if verify:
            self._verify(key, member, data, payload, None)
        if dtype.kind == "V":
            raise FormatError(f"is raw bytes ({dtype}) and no manifest says what they are", path=self.name, key=key)
        dtype_name(dtype, key)
        array = np.frombuffer(payload, dtype=dtype, count=math.prod(shape)) if payload.nbytes else np.empty(0, dtype)
        array = array.reshape(shape, order="F" if fortran else "C")
        return array if dtype.isnative else array.astype(dtype.newbyteorder("="))

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        """Read a stored tensor straight into ``out``; False when only :meth:`read` can.

        That is: deflated, no manifest, or (when verifying) no checksum in the manifest, where
        :meth:`read` checks the zip CRC-32 instead.
        """
        member = self._member(key)
        self._source.check_unchanged(f"tensor {key!r}")
        if member.method != STORED or self._manifest is None or self._codecs.get(key):
            return False
        info, layout = self._listed(key, member)
        if verify and not info.checksum:
            return False
        start = self._data_offset(member)
        self._check_header(key, info, layout, memoryview(self._source.read_at(start, len(layout.header))))
        payload = raw_bytes(out) if out.nbytes else memoryview(b"")
        self._source.read_into(start + len(layout.header), out.reshape(-1).view(np.uint8).data)
        if verify and checksum(payload) != info.checksum:
            raise ChecksumError(f"is corrupt (checksum {checksum(payload)}, manifest {info.checksum})", path=self.name, key=key)
        return True

    def _verify(self, key: str, member: _zipdir.Member, data: memoryview, payload: memoryview,
                info: TensorInfo | None) -> None:
        if info is not None and info.checksum:
            actual = checksum(payload)
            if actual != info.checksum:
                raise ChecksumError(f"is corrupt (checksum {actual}, manifest {info.checksum})", path=self.name, key=key)
        elif crc32(data) != member.crc:
            raise ChecksumError("is corrupt (zip CRC-32 mismatch)", path=self.name, key=key)

    def close(self) -> None:
        self._source.close()


def _text_scalar(data: memoryview) -> tuple[str, int] | None:
    """``(encoding, start)`` of the text in ``data``, if it is a text scalar as numpy writes one
    (a version 1 header that :data:`_TEXT_SCALAR_HEADER` matches, then exactly the text it
    declares): what :meth:`NpzReader._parse_npy` reads there, without numpy. ``None`` for any
    other bytes, which that reads (and refuses, naming what is wrong)."""
    if len(data) < 10 or data[:8] != _NPY_V1:
        return None
    header_len = int.from_bytes(data[8:10], "little")
    found = _TEXT_SCALAR_HEADER.fullmatch(bytes(data[10 : 10 + header_len])) if header_len <= MAX_NPY_HEADER else None
    if found is None or len(data) - 10 - header_len != 4 * int(found[2]):
        return None
    return "utf-32-le" if found[1] == b"<" else "utf-32-be", 10 + header_len


def _same_keys(listed: list[str], members: dict[str, str]) -> bool:
    """Whether the manifest lists exactly the members' keys: in the same order (as written), one
    comparison of two lists; in any other, as sets."""
    return listed == list(members) or (len(listed) == len(members) and set(listed) == members.keys())
