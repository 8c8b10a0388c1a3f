#!/usr/bin/env python3
"""Regenerate lychee_compile/data/persuasion.txt: Jane Austen's *Persuasion* (1817-18, public domain) as plain text.

Source: the Debian package r-cran-janeaustenr (the R package `janeaustenr`, whose text comes from Project
Gutenberg). Its lazy-load database `janeaustenr/data/Rdata.rdb` is a sequence of objects, each a 4-byte big-endian
length followed by a zlib stream holding an R XDR serialization; `Rdata.rdx` is the index (object name -> offset,
length; a gzip'ed saveRDS file). Each novel is a character vector with one string per line. This script reads them with the standard
library only (no R needed).

Usage:
    python scripts/extract_persuasion.py                  # apt-get download r-cran-janeaustenr into a temp dir
    python scripts/extract_persuasion.py --deb FILE.deb   # use a downloaded .deb
    python scripts/extract_persuasion.py --data-dir DIR   # DIR holds Rdata.rdb and Rdata.rdx
    python scripts/extract_persuasion.py --list           # print the objects in the database
Writes lychee_compile/data/persuasion.txt (or --out) and prints its size and sha256.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import struct
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "lychee_compile" / "data" / "persuasion.txt"

# R SEXP type codes (src/include/Rinternals.h, serialize.c)
NILSXP, SYMSXP, LISTSXP, CHARSXP, LGLSXP, INTSXP, REALSXP, STRSXP, VECSXP = 0, 1, 2, 9, 10, 13, 14, 16, 19
REFSXP, NILVALUE_SXP, GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP = 255, 254, 253, 242, 241
MISSINGARG_SXP, BASENAMESPACE_SXP = 251, 247
NA_INT = -2147483648


class RVector(list):
    """A decoded R vector; `attributes` holds e.g. {'names': [...]}."""
    attributes: dict


class XDRReader:
    """Minimal reader of R's XDR serialization format (versions 2 and 3) for vectors, lists and pairlists."""

    def __init__(self, data: bytes):
        self.data, self.pos, self.refs = data, 0, []

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return value

    def _bytes(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def read(self):
        fmt = self._bytes(2)
        if fmt != b"X\n":
            raise ValueError(f"not an XDR R serialization (format {fmt!r}); expected b'X\\n'")
        version = self._int()
        self._int()  # writer R version
        self._int()  # minimal reader version
        if version == 3:
            self._bytes(self._int())  # native encoding name
        elif version != 2:
            raise ValueError(f"unsupported R serialization version {version}")
        return self._item()

    def _length(self) -> int:
        n = self._int()
        if n == -1:
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def _attributes(self, flags: int, obj):
        if flags & (1 << 9):
            attrs = self._item()  # a pairlist: dict
            if isinstance(obj, RVector):
                obj.attributes = attrs if isinstance(attrs, dict) else {}
        return obj

    def _item(self):
        flags = self._int()
        kind = flags & 0xFF
        if kind in (NILVALUE_SXP, NILSXP):
            return None
        if kind in (GLOBALENV_SXP, EMPTYENV_SXP, BASEENV_SXP, MISSINGARG_SXP, BASENAMESPACE_SXP):
            return f"<R special {kind}>"
        if kind == REFSXP:
            index = flags >> 8 or self._int()
            return self.refs[index - 1]
        if kind == SYMSXP:
            name = self._item()
            self.refs.append(name)
            return name
        if kind == CHARSXP:
            n = self._int()
            if n == -1:
                return None  # NA_character_
            raw = self._bytes(n)
            return raw.decode("latin-1") if (flags >> 12) & 4 else raw.decode("utf-8")  # LATIN1_MASK = 4
        if kind == LISTSXP:  # pairlist -> dict (tag -> value), attributes ignored
            out = {}
            while kind == LISTSXP:
                if flags & (1 << 9):
                    self._item()
                tag = self._item() if flags & (1 << 10) else len(out)
                out[tag] = self._item()
                flags = self._int()
                kind = flags & 0xFF
            if kind not in (NILVALUE_SXP, NILSXP):
                raise ValueError(f"unexpected pairlist terminator type {kind}")
            return out
        if kind in (LGLSXP, INTSXP):
            n = self._length()
            values = RVector(v if v != NA_INT else None for v in struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
            values.attributes = {}
            return self._attributes(flags, values)
        if kind == REALSXP:
            n = self._length()
            values = RVector(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
            values.attributes = {}
            return self._attributes(flags, values)
        if kind in (STRSXP, VECSXP):
            n = self._length()
            values = RVector(self._item() for _ in range(n))
            values.attributes = {}
            return self._attributes(flags, values)
        raise ValueError(f"R object type {kind} is not supported by this small reader")


def read_index(rdx: Path) -> dict[str, tuple[int, int]]:
    raw = rdx.read_bytes()  # the index is a saveRDS file: gzip around the XDR serialization
    index = XDRReader(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else zlib.decompress(raw[4:])).read()
    names = index.attributes["names"]
    variables = index[names.index("variables")]
    return {name: (pos[0], pos[1]) for name, pos in zip(variables.attributes["names"], variables)}


def read_object(rdb: Path, offset: int, length: int):
    with open(rdb, "rb") as f:
        f.seek(offset)
        blob = f.read(length)
    (size,) = struct.unpack(">I", blob[:4])
    data = zlib.decompress(blob[4:])
    if len(data) != size:
        raise ValueError(f"object at {offset}: expected {size} bytes after zlib, got {len(data)}")
    return XDRReader(data).read()


def data_dir_from_deb(deb: Path, workdir: Path) -> Path:
    subprocess.run(["dpkg-deb", "-x", str(deb), str(workdir / "x")], check=True)
    hits = list((workdir / "x").rglob("janeaustenr/data/Rdata.rdb"))
    if not hits:
        raise SystemExit(f"{deb} holds no janeaustenr/data/Rdata.rdb")
    return hits[0].parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--deb", type=Path, help="r-cran-janeaustenr .deb file")
    src.add_argument("--data-dir", type=Path, help="folder holding Rdata.rdb and Rdata.rdx")
    parser.add_argument("--book", default="persuasion", help="object name in the database (default persuasion)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--list", action="store_true", help="list the objects and exit")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.data_dir:
            data_dir = args.data_dir
        else:
            deb = args.deb
            if deb is None:
                subprocess.run(["apt-get", "download", "r-cran-janeaustenr"], cwd=tmp, check=True)
                deb = next(tmp.glob("r-cran-janeaustenr_*.deb"))
            data_dir = data_dir_from_deb(deb, tmp)
        index = read_index(data_dir / "Rdata.rdx")
        if args.list:
            for name, (offset, length) in index.items():
                print(f"{name:24s} offset {offset:8d} length {length:8d}")
            return 0
        if args.book not in index:
            raise SystemExit(f"no object {args.book!r}; the database holds {sorted(index)}")
        lines = read_object(data_dir / "Rdata.rdb", *index[args.book])
        if not all(isinstance(line, str) for line in lines):
            raise SystemExit(f"{args.book!r} is not a character vector without NA")
        text = "\n".join(lines).strip() + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    print(f"wrote {args.out} ({len(text.encode('utf-8'))} bytes, {len(lines)} lines, sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
