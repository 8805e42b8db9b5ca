"""Hand-made hostile files for the bad-input tests.

Zips are built with :mod:`struct` rather than :mod:`zipfile`, because a hostile file is exactly
one that ``zipfile`` would refuse to write: duplicate names, overlapping members, lying sizes.
"""

from __future__ import annotations

import struct
import subprocess
import zipfile
import zlib
from dataclasses import dataclass, field

import numpy as np
import pytest
from processes import run_forked

_LOCAL = struct.Struct("<4s5H3I2H")
_CENTRAL = struct.Struct("<4s6H3I5H2I")
_EOCD = struct.Struct("<4s4H2IH")
STORED, DEFLATED, BZIP2, LZMA = 0, 8, 12, 14


def npy(array: np.ndarray) -> bytes:
    """An ordinary ``.npy`` file's bytes (v1.0 header, C order)."""
    array = np.ascontiguousarray(array)
    return npy_raw(np.lib.format.dtype_to_descr(array.dtype), array.shape, array.tobytes())


def npy_raw(descr, shape, payload: bytes, *, header_text: str | None = None, version: int = 1) -> bytes:
    """An ``.npy`` file whose header says whatever the caller wants, over any payload."""
    if header_text is None:
        header_text = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    text = header_text.encode("latin1")
    prefix = 10 if version == 1 else 12
    text += b" " * (-(prefix + len(text) + 1) % 64) + b"\n"
    length = struct.pack("<H", len(text)) if version == 1 else struct.pack("<I", len(text))
    return b"\x93NUMPY" + bytes([version, 0]) + length + text + payload


@dataclass
class Member:
    """One zip member. ``data`` is what lies in the file; the other fields may lie about it."""

    name: bytes | str
    data: bytes
    method: int = STORED
    size: int | None = None  # uncompressed size the headers claim; len(data) when None
    crc: int | None = None
    offset: int | None = None  # central directory's local-header offset; the real one when None
    flags: int = 0x800
    extra: bytes = field(default=b"")

    @property
    def raw_name(self) -> bytes:
        return self.name.encode("utf-8") if isinstance(self.name, str) else self.name


def deflated(payload: bytes) -> bytes:
    engine = zlib.compressobj(9, zlib.DEFLATED, -15)
    return engine.compress(payload) + engine.flush()


def zip_bytes(members: list[Member], *, extra_central: list[Member] = ()) -> bytes:
    """A zip holding ``members``; ``extra_central`` adds central entries with no local data."""
    out = bytearray()
    entries = []
    for member in members:
        offset = len(out)
        size = len(member.data) if member.size is None else member.size
        crc = zlib.crc32(member.data) if member.crc is None else member.crc
        out += _LOCAL.pack(b"PK\x03\x04", 20, member.flags, member.method, 0, 0x21, crc, len(member.data), size,
                           len(member.raw_name), len(member.extra))
        out += member.raw_name + member.extra + member.data
        entries.append((member, offset if member.offset is None else member.offset, crc, size))
    for member in extra_central:
        size = len(member.data) if member.size is None else member.size
        entries.append((member, member.offset or 0, member.crc or zlib.crc32(member.data), size))
    directory = len(out)
    for member, offset, crc, size in entries:
        out += _CENTRAL.pack(b"PK\x01\x02", 20, 20, member.flags, member.method, 0, 0x21, crc, len(member.data), size,
                             len(member.raw_name), 0, 0, 0, 0, 0, offset)
        out += member.raw_name
    out += _EOCD.pack(b"PK\x05\x06", 0, 0, len(entries), len(entries), len(out) - directory, directory, 0)
    return bytes(out)


def data_offsets(path) -> dict[str, tuple[int, int]]:
    """Member name -> (offset of its data in the file, stored length), read with the stdlib."""
    import zipfile

    result = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as handle:
        for info in archive.infolist():
            handle.seek(info.header_offset)
            local = _LOCAL.unpack(handle.read(_LOCAL.size))
            result[info.filename] = (info.header_offset + _LOCAL.size + local[9] + local[10], info.compress_size)
    return result


def npy_data_offset(path, member: str) -> int:
    """Where the array bytes (after the npy header) of an uncompressed member start in the file."""
    start, _ = data_offsets(path)[member]
    with open(path, "rb") as handle:
        handle.seek(start)
        head = handle.read(12)
    assert head[:6] == b"\x93NUMPY", head
    if head[6] == 1:
        return start + 10 + struct.unpack("<H", head[8:10])[0]
    return start + 12 + struct.unpack("<I", head[8:12])[0]


def flip_bit(path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ (1 << bit)]))


def deflated_npy_zeros(descr: str, shape: tuple[int, ...]) -> tuple[bytes, int, int]:
    """``(deflate stream, inflated size, CRC-32)`` of an npy of zeros, built without holding it."""
    header = npy_raw(descr, shape, b"")
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(descr).itemsize
    engine = zlib.compressobj(9, zlib.DEFLATED, -15)
    parts, crc = [engine.compress(header)], zlib.crc32(header)
    block = bytes(16 << 20)
    left = nbytes
    while left:
        piece = block[: min(left, len(block))]
        parts.append(engine.compress(piece))
        crc = zlib.crc32(piece, crc)
        left -= len(piece)
    parts.append(engine.flush())
    return b"".join(parts), len(header) + nbytes, crc


def peak_rss_growth(code: str, *, timeout: float = 120) -> tuple[int, str]:
    """Run ``code`` in a fresh Python after importing weightstore and its formats (h5py is
    not small); return how far its peak resident memory rose above the peak before ``code``
    (bytes), and what it printed.

    The peak is ``VmHWM`` from ``/proc/self/status``, which belongs to the process's own
    address space; ``ru_maxrss`` would not do, as Linux carries the parent's peak across
    fork and exec into the child's.
    """
    import subprocess
    import sys

    script = (
        "import numpy as np, weightstore as ws, weightstore.formats.npz, weightstore.formats.hdf5\n"
        "def _peak():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmHWM:'):\n"
        "            return int(line.split()[1]) * 1024\n"
        "base = _peak()\n"
        + code
        + "\nprint('GROWTH', _peak() - base)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr
    growth = [line for line in result.stdout.splitlines() if line.startswith("GROWTH ")]
    return int(growth[-1].split()[1]), result.stdout


def run_isolated(code: str, *, timeout: float = 60, address_space: int | None = None,
                 file_size: int | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a process of its own after ``import weightstore as ws``, under resource
    limits, so that a crash (SIGBUS, SIGSEGV), a hang or a runaway allocation is reported, not
    fatal. The process is forked from one that imported numpy, h5py and weightstore once for this
    worker (``processes.run_forked``): not an interpreter's start and imports each.

    ``address_space`` caps virtual memory above what the process maps when it starts (h5py and
    numpy map a lot); ``file_size`` caps any file written, with SIGXFSZ ignored so a write past
    it fails with EFBIG the way a full disk fails with ENOSPC. Past ``timeout`` seconds the
    process is ended by SIGALRM (exit code -14).
    """
    limits = (
        "import resource, signal\n"
        + (
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({file_size}, {file_size}))\n"
            if file_size is not None else ""
        )
        + (
            "_mapped = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
            f"resource.setrlimit(resource.RLIMIT_AS, (_mapped + {address_space}, _mapped + {address_space}))\n"
            if address_space is not None else ""
        )
    )
    script = "import numpy as np, weightstore as ws, weightstore.formats.hdf5\n" + limits + code
    return run_forked(script, timeout=timeout)


def raises_naming(exc_type, *names):
    """``pytest.raises`` that also checks the message names every one of ``names``."""
    return _Naming(exc_type, names)


class _Naming:
    def __init__(self, exc_type, names):
        self._ctx = pytest.raises(exc_type)
        self._names = [str(n) for n in names]

    def __enter__(self):
        self.info = self._ctx.__enter__()
        return self.info

    def __exit__(self, *exc):
        suppressed = self._ctx.__exit__(*exc)
        if suppressed:
            message = str(self.info.value)
            for name in self._names:
                assert name in message, f"{name!r} not in {message!r}"
        return suppressed


def manifest_entries(document: dict) -> dict[str, dict]:
    """A manifest's tensors (version 2: columns) as one entry per key, the way a person reads
    them: ``dtype``, ``shape``, ``checksum`` (``crc32:…``), and ``location``/``codec`` where set."""
    columns = document["tensors"]
    entries, start = {}, 0
    for row, key in enumerate(columns["keys"]):
        ndim = columns["ndim"][row]
        entries[key] = {"dtype": columns["dtypes"][columns["dtype"][row]],
                        "shape": columns["shape"][start : start + ndim],
                        "checksum": f"crc32:{columns['crc32'][row]:08x}"}
        start += ndim
        for field_name in ("location", "codec"):
            if key in columns.get(field_name, {}):
                entries[key][field_name] = columns[field_name][key]
    return entries


def hostile_keras(path, payload, *, declared=None, crc=None):
    """A .keras zip whose one deflated model.weights.h5 declares ``declared`` bytes (and ``crc``)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("model.weights.h5", payload)
    data = bytearray(path.read_bytes())
    for signature, crc_at, size_at in ((b"PK\x03\x04", 14, 22), (b"PK\x01\x02", 16, 24)):  # local, central
        header = data.index(signature)
        if declared is not None:
            data[header + size_at: header + size_at + 4] = declared.to_bytes(4, "little")
        if crc is not None:
            data[header + crc_at: header + crc_at + 4] = crc.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path
