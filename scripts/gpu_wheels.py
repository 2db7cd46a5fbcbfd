r"""The GPU report's extras as wheels that travel with the working tree (the GPU machine has no network).

    python scripts/gpu_wheels.py download [--dest .whl] [--budget-mib M]  # here, with pip (`make gpu-wheels`)
    python scripts/gpu_wheels.py pack [--dest DIR]                         # repack + manifest what DIR holds
    python3 scripts/gpu_wheels.py install [--src .whl] [--target /tmp/site] [--check-imports MODS]  # there

download: `pip download --no-deps` of exactly requirements-gpu.txt for CPython 3.12 on manylinux x86_64 (the GPU
machine's python), then `pack`. A requirement already packed in the manifest at its pinned version is not fetched
again; files in the folder that no requirement names are removed (two versions of one package stop the install).

pack: each wheel over --repack-over-mib (default 0: every one) becomes `<wheel>.tar.xz` (its .whl deleted): the
zip's members' data, uncompressed, and its "skeleton" (every other byte of the zip: headers, central directory),
in xz (the x86 filter, LZMA2 preset 9e, a dictionary as large as the data: 40% smaller than the wheels' deflate;
nvidia-cutlass-dsl-libs-cu13's 87.7 MiB wheel is 49.3 MiB, ~4 min of one core). zlib redeflates each member to
the wheel's own bytes at the level it was written with (found here per member; a member it does not reproduce
stays in the skeleton as it is), so the rebuild is the original wheel: checked here before its .whl goes, and
there against the manifest's sha256. manifest.json records each wheel's name, version, file, sha256, size, packed
size and content digest, and the zlib that packed it. The folder must fit what the device tool's 64 MiB carry
leaves beside the tree it sends (default --budget-mib: 64 less git's files here, less 1): over it is a one-line
error naming the largest files.

install: rebuild each packed wheel and check its sha256 (a mismatch: a one-line error naming the file; only where
this zlib differs from the packer's, whose deflate may differ in bytes and lengths, a new zip of the same members
is written and their contents checked instead), then one `pip install --no-index --no-deps --no-compile --target
T` of every wheel, an import of each --check-imports module in a fresh interpreter (reported, not fatal), and one
line: what is installed (name==version), the imports, and the PYTHONPATH to export (the target and the folders its
.pth files add, which a --target install does not process: nvidia-cutlass-dsl's `cutlass` lives in one). Never
installs torch or triton. Exit status: 0, 1 with a one-line error, 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
import zlib
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from checkpoint.verify import sha256_file  # noqa: E402
from scripts.lock_requirements import canonical  # noqa: E402

REQUIREMENTS = os.path.join(ROOT, "requirements-gpu.txt")
MANIFEST = "manifest.json"
PACKED = ".tar.xz"
FORMAT = 1
TARGET_PYTHON = "3.12"
# the platform tags pip matches exactly (README of the device tool); 2_24 and 2_28: apache-tvm-ffi, the cutlass libs
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")
# what gpu_report.py imports after the install (its header says whether each loads): FA4's kernels (they load
# the CuTe DSL's compiler, the cu13 .so), torchtitan (its optimizer module: its llama3 package imports `datasets`,
# which the image lacks and bench/titan_peer.py stands in for), Liger-Kernel, quack, torchao's float8 training (the
# FP8 rows)
CHECK_IMPORTS = ("flash_attn.cute", "torchtitan.components.optimizer", "liger_kernel", "quack", "torchao.float8")
NEVER = {"torch", "triton"}  # the image's own: a wheel of either here would replace the measured stack
CHUNK = 1 << 20
CARRY_MIB = 64  # the device tool's limit on what travels: the tree it sends and the carried folders together
TREE_GROWTH_MIB = 0.5  # kept free for the tree to grow between `make gpu-wheels` and the GPU call


def default_budget_mib() -> float:
    """What the carry leaves for the wheels: 64 MiB less the files the device tool sends with them (git's
    tracked and untracked-not-ignored files here), less TREE_GROWTH_MIB for the tree to grow; 56 outside a git
    checkout."""
    try:
        r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, timeout=60, check=True)
        tree = sum(os.path.getsize(os.path.join(ROOT, f)) for f in r.stdout.decode().split("\0")
                   if f and os.path.isfile(os.path.join(ROOT, f)))
        return round(CARRY_MIB - tree / 2**20 - TREE_GROWTH_MIB, 1)
    except (OSError, subprocess.SubprocessError, UnicodeDecodeError):
        return 56.0


class WheelsError(Exception):
    """One line for the user, naming the file at fault."""


def read_requirements(path: str = REQUIREMENTS) -> list[tuple[str, str]]:
    """(name, version) of each `name==version` line; anything else but comments is an error naming the line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
            if not m:
                raise WheelsError(f"{path}:{lineno}: {line!r} is not name==version (every GPU wheel is pinned)")
            if canonical(m.group(1)) in NEVER:
                raise WheelsError(f"{path}:{lineno}: {m.group(1)} is the GPU image's own; it is never carried")
            out.append((m.group(1), m.group(2)))
    return out


def wheel_meta(path: str) -> tuple[str, str]:
    """(Name, Version) from the wheel's METADATA."""
    try:
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
            text = z.read(name).decode("utf-8", "replace")
    except (zipfile.BadZipFile, StopIteration, OSError) as e:
        raise WheelsError(f"{path}: not a readable wheel ({e or 'no METADATA'})") from None
    fields = dict(re.findall(r"^(Name|Version): *(.+?)\s*$", text, re.M))
    if "Name" not in fields or "Version" not in fields:
        raise WheelsError(f"{path}: its METADATA has no Name or Version")
    return fields["Name"], fields["Version"]


# ------------------------------------------------------------------------------------------ repack / rebuild
def _deflate(data: bytes, level: int, mem_level: int) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, -15, mem_level)
    return c.compress(data) + c.flush()


def _find_level(data: bytes, raw: bytes) -> Optional[tuple[int, int]]:
    """The zlib (level, memLevel) that turns data into exactly raw, or None. Level 6 (zlib's default, what the
    wheel builders use) first; a large member is tried at 6 and 9 only (each try deflates it whole)."""
    tries = [(6, 8), (9, 8)] if len(data) > 16 * CHUNK else \
        [(6, 8)] + [(lv, m) for m in (8, 9) for lv in (9, 5, 4, 7, 8, 3, 2, 1, 6) if (lv, m) != (6, 8)]
    for level, mem in tries:
        if _deflate(data, level, mem) == raw:
            return level, mem
    return None


def _members(path: str) -> list[dict]:
    """Each member's data region in the zip file: offset, length, method, name, size."""
    out = []
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            f.seek(info.header_offset)
            head = f.read(30)
            if head[:4] != b"PK\x03\x04":
                raise WheelsError(f"{path}: member {info.filename} has no local header")
            start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + \
                int.from_bytes(head[28:30], "little")
            out.append({"name": info.filename, "offset": start, "length": info.compress_size,
                        "method": info.compress_type, "size": info.file_size})
    return sorted(out, key=lambda m: m["offset"])


def content_sha256(path: str) -> str:
    """sha256 over every member's name and data, in the zip's order: what a wheel holds, whatever its deflate."""
    h = hashlib.sha256()
    with zipfile.ZipFile(path) as z:
        for info in z.infolist():
            h.update(info.filename.encode() + b"\0" + hashlib.sha256(z.read(info)).digest())
    return h.hexdigest()


def _xz_filters(total: int) -> list[dict]:
    # a dictionary as large as the data (up to 256 MiB): the big .so files share code far apart
    dict_size = max(1 << 20, min(256 << 20, 1 << max(0, total - 1).bit_length()))
    # lc=4, pb=0: x86 code is byte-aligned (0.4% smaller than preset 9e's lc=3, pb=2 on the cu13 .so)
    return [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME,
                                       "dict_size": dict_size, "lc": 4, "lp": 0, "pb": 0}]


def repack(wheel: str, out: str, xz_filters: Optional[list] = None) -> dict:
    """wheel -> out (.tar.xz): layout.json, skeleton.bin (the zip less the data cut out), m/NNNNN (each cut
    member's data, uncompressed). A deflated member whose stream zlib does not reproduce stays in the skeleton."""
    members = _members(wheel)
    with open(wheel, "rb") as f:
        blob = f.read()
    skeleton, cuts, datas, pos, where = bytearray(), [], [], 0, {}
    with zipfile.ZipFile(wheel) as z:
        infos = z.infolist()
        for m in members:
            raw = blob[m["offset"]:m["offset"] + m["length"]]
            how = None
            if m["method"] == zipfile.ZIP_STORED:
                data, how = raw, {"method": "stored"}
            elif m["method"] == zipfile.ZIP_DEFLATED:
                data = z.read(m["name"])
                found = _find_level(data, raw)
                if found is not None:
                    how = {"method": "deflate", "level": found[0], "mem_level": found[1]}
            if how is None:  # kept as it is, where the skeleton holds it
                where[m["name"]] = {"at": len(skeleton) + m["offset"] - pos, "length": m["length"]}
                continue
            skeleton += blob[pos:m["offset"]]
            pos = m["offset"] + m["length"]
            where[m["name"]] = {"cut": len(cuts)}
            cuts.append(dict(how, name=m["name"], at=len(skeleton), length=m["length"], size=len(data)))
            datas.append(data)
    skeleton += blob[pos:]
    # every member as zipfile sees it: what a fresh zip of the same contents needs (rebuild's fallback)
    entries = [dict(where[i.filename], name=i.filename, date_time=list(i.date_time), external_attr=i.external_attr,
                    method=i.compress_type) for i in infos]
    layout = {"format": FORMAT, "wheel": os.path.basename(wheel), "size": len(blob),
              "sha256": hashlib.sha256(blob).hexdigest(), "zlib": zlib.ZLIB_RUNTIME_VERSION, "cuts": cuts,
              "members": entries}
    total = len(skeleton) + sum(len(d) for d in datas)
    tmp = out + ".part"
    with lzma.LZMAFile(tmp, "wb", format=lzma.FORMAT_XZ, filters=xz_filters or _xz_filters(total)) as xzf, \
            tarfile.open(fileobj=xzf, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [("layout.json", json.dumps(layout, indent=1).encode()), ("skeleton.bin", bytes(skeleton))] \
                + [(f"m/{i:05d}", d) for i, d in enumerate(datas)]:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
            tar.addfile(ti, io.BytesIO(data))
    os.replace(tmp, out)
    return layout


def _write_exact(path: str, layout: dict, skeleton: bytes, datas) -> str:
    """The skeleton with each cut member's data put back (deflated as the wheel was): the wheel's own bytes."""
    h, pos = hashlib.sha256(), 0
    with open(path, "wb") as f:
        def put(b: bytes) -> None:
            h.update(b)
            f.write(b)
        for cut, data in zip(layout["cuts"], datas):
            put(skeleton[pos:cut["at"]])
            pos = cut["at"]
            put(data if cut["method"] == "stored" else _deflate(data, cut["level"], cut["mem_level"]))
        put(skeleton[pos:])
    return h.hexdigest()


def _write_fresh(path: str, layout: dict, skeleton: bytes, datas) -> str:
    """A new zip of the same members (names, times, modes, contents), deflated by this zlib: where this zlib's
    deflate differs from the packer's, the exact bytes' headers (sizes, offsets) no longer fit them."""
    datas = list(datas)
    with zipfile.ZipFile(path, "w") as z:
        for m in layout["members"]:
            if "cut" in m:
                data = datas[m["cut"]]
            else:
                raw = skeleton[m["at"]:m["at"] + m["length"]]
                if m["method"] not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
                    raise WheelsError(f"{layout['wheel']}: member {m['name']} has compression method {m['method']}")
                data = raw if m["method"] == zipfile.ZIP_STORED else zlib.decompress(raw, -15)
            info = zipfile.ZipInfo(m["name"], tuple(m["date_time"]))
            info.external_attr = m["external_attr"]
            z.writestr(info, data, compress_type=zipfile.ZIP_STORED if m["method"] == zipfile.ZIP_STORED
                       else zipfile.ZIP_DEFLATED)
    return sha256_file(path)


def rebuild(packed: str, out_dir: str, fresh: bool = False) -> tuple[str, str, dict]:
    """packed .tar.xz -> the wheel in out_dir (fresh: a new zip of the same members, _write_fresh); returns
    (path, sha256 of what was written, layout). A truncated or corrupt archive is a one-line error naming it."""
    try:
        with tarfile.open(packed, mode="r|xz") as tar:
            it = iter(tar)

            def next_file(expect: str) -> bytes:
                ti = next(it, None)
                if ti is None:
                    raise WheelsError(f"{packed}: the archive ends before {expect} (truncated)")
                if ti.name != expect:
                    raise WheelsError(f"{packed}: expected {expect} in the archive, found {ti.name}")
                return tar.extractfile(ti).read()
            layout = json.loads(next_file("layout.json"))
            skeleton = next_file("skeleton.bin")
            path = os.path.join(out_dir, os.path.basename(layout["wheel"]))
            datas = (next_file(f"m/{i:05d}") for i in range(len(layout["cuts"])))
            digest = (_write_fresh if fresh else _write_exact)(path, layout, skeleton, datas)
    except WheelsError:
        raise
    except (lzma.LZMAError, tarfile.TarError, zlib.error, EOFError, KeyError, ValueError,
            OSError) as e:
        raise WheelsError(f"{packed}: corrupt or truncated archive ({type(e).__name__}: {e})"[:300]) from None
    return path, digest, layout


# ------------------------------------------------------------------------------------------ pack / download
def _human(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def check_budget(dest: str, budget_mib: float) -> int:
    files = [(os.path.getsize(os.path.join(dest, n)), n) for n in os.listdir(dest)
             if os.path.isfile(os.path.join(dest, n))]
    total = sum(s for s, _ in files)
    if total > budget_mib * 2**20:
        largest = ", ".join(f"{n} {_human(s)}" for s, n in sorted(files, reverse=True)[:3])
        raise WheelsError(f"{dest} holds {_human(total)}, over the {budget_mib:g} MiB carry budget (--budget-mib); "
                          f"largest: {largest}")
    return total


def pack(dest: str, repack_over_mib: float = 0.0, budget_mib: float = 56.0,
         log: Callable[[str], None] = print) -> dict:
    """Repack the large wheels in dest, write manifest.json (entries of wheels packed earlier kept), check the
    budget. Returns the manifest."""
    for name in os.listdir(dest):
        if name.endswith(".part"):  # a repack that was stopped
            os.remove(os.path.join(dest, name))
    old = {}
    if os.path.exists(os.path.join(dest, MANIFEST)):
        old = {w["file"]: w for w in load_manifest(dest)["wheels"]}
    wheels, seen = [], {}
    for name in sorted(os.listdir(dest)):
        path = os.path.join(dest, name)
        if name.endswith(".whl"):
            dist, version = wheel_meta(path)
            entry = {"name": dist, "version": version, "file": name, "sha256": sha256_file(path),
                     "size": os.path.getsize(path), "packed": None, "packed_size": None}
            if entry["size"] > repack_over_mib * 2**20:
                t0 = time.perf_counter()
                entry["content_sha256"] = content_sha256(path)
                repack(path, path + PACKED)
                check_rebuilds(path + PACKED, entry["sha256"])
                os.remove(path)
                entry.update(packed=name + PACKED, packed_size=os.path.getsize(path + PACKED))
                log(f"gpu-wheels: repacked {name} ({_human(entry['size'])}) as {entry['packed']} "
                    f"({_human(entry['packed_size'])}) in {time.perf_counter() - t0:.0f} s")
        elif name.endswith(".whl" + PACKED) and name[:-len(PACKED)] in old:
            entry = old[name[:-len(PACKED)]]
        else:
            continue
        key = canonical(entry["name"])
        if key in seen:
            raise WheelsError(f"{dest}: two wheels of {entry['name']}: {seen[key]} and {name} (keep one)")
        seen[key] = name
        wheels.append(entry)
    manifest = {"format": FORMAT, "target": {"python": TARGET_PYTHON, "platforms": list(PLATFORMS)},
                "zlib": zlib.ZLIB_RUNTIME_VERSION, "wheels": wheels}
    with open(os.path.join(dest, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    total = check_budget(dest, budget_mib)
    log(f"gpu-wheels: {dest}: {len(wheels)} wheels, {_human(total)} (budget {budget_mib:g} MiB)")
    return manifest


def check_rebuilds(packed: str, sha256: str) -> None:
    """Rebuild the wheel here once, in a scratch folder: the archive must give the wheel back before it goes."""
    with tempfile.TemporaryDirectory() as tmp:
        _, digest, _ = rebuild(packed, tmp)
    if digest != sha256:
        raise WheelsError(f"{packed}: rebuilding it here does not give the wheel back (sha256 {digest[:12]} "
                          f"!= {sha256[:12]}): a bug in the repack")


def load_manifest(src: str) -> dict:
    path = os.path.join(src, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("format") != FORMAT or not isinstance(manifest.get("wheels"), list):
            raise ValueError(f"format {manifest.get('format')!r}, expected {FORMAT}")
        return manifest
    except (OSError, ValueError) as e:
        raise WheelsError(f"{path}: unreadable manifest ({e}); run `make gpu-wheels`") from None


def pip_download_cmd(dest: str, specs: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp"]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    return cmd + ["-d", dest] + specs


def download(dest: str, requirements: str = REQUIREMENTS, repack_over_mib: float = 0.0, budget_mib: float = 56.0,
             log: Callable[[str], None] = print) -> dict:
    reqs = read_requirements(requirements)
    os.makedirs(dest, exist_ok=True)
    have = {}
    if os.path.exists(os.path.join(dest, MANIFEST)):
        have = {(canonical(w["name"]), w["version"]) for w in load_manifest(dest)["wheels"]
                if w.get("packed") and os.path.exists(os.path.join(dest, w["packed"]))}
    want = {canonical(n): v for n, v in reqs}
    # what no requirement names at its pinned version goes (an older version's wheel would stop the install)
    for name in sorted(os.listdir(dest)):
        m = re.match(r"([^-]+)-([^-]+)-", name)
        if name != MANIFEST and not (m and want.get(canonical(m.group(1))) == m.group(2)):
            log(f"gpu-wheels: removing {name} (not in {os.path.basename(requirements)})")
            path = os.path.join(dest, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    specs = [f"{n}=={v}" for n, v in reqs if (canonical(n), v) not in have]
    if specs:
        t0 = time.perf_counter()
        r = subprocess.run(pip_download_cmd(dest, specs), capture_output=True, text=True)
        if r.returncode != 0:
            err = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.startswith("ERROR")] or ["(no ERROR line)"]
            raise WheelsError(f"pip download failed for {requirements}: {err[0]}")
        log(f"gpu-wheels: downloaded {len(specs)} wheels in {time.perf_counter() - t0:.0f} s")
    manifest = pack(dest, repack_over_mib, budget_mib, log)
    got = {canonical(w["name"]): w["version"] for w in manifest["wheels"]}
    missing = [f"{n}=={v}" for n, v in reqs if got.get(canonical(n)) != v]
    if missing:
        raise WheelsError(f"{dest}: no wheel for {', '.join(missing)} after the download")
    return manifest


# ------------------------------------------------------------------------------------------ install (GPU machine)
CROSS_ARGS = ["--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp"] + \
    [a for plat in PLATFORMS for a in ("--platform", plat)]


def verified_wheels(src: str, manifest: dict, work: str, log: Callable[[str], None] = print) -> list[str]:
    """The manifest's wheels as files, the packed ones rebuilt into work; each checked against its sha256."""
    listed = {w["packed"] or w["file"] for w in manifest["wheels"]}
    strays = sorted(n for n in os.listdir(src) if n.endswith((".whl", PACKED)) and n not in listed)
    if strays:
        raise WheelsError(f"{os.path.join(src, strays[0])}: not in {MANIFEST} (run `make gpu-wheels` again)")
    paths = []
    for w in manifest["wheels"]:
        if canonical(w["name"]) in NEVER:
            raise WheelsError(f"{os.path.join(src, w['packed'] or w['file'])}: {w['name']} is never installed here")
        if w["packed"]:
            packed = os.path.join(src, w["packed"])
            if not os.path.exists(packed):
                raise WheelsError(f"{packed}: missing (listed in {MANIFEST})")
            path, digest, layout = rebuild(packed, work)
            if digest != w["sha256"]:
                if layout.get("zlib") == zlib.ZLIB_RUNTIME_VERSION or not w.get("content_sha256"):
                    raise WheelsError(f"{packed}: the rebuilt wheel's sha256 {digest[:16]} is not the manifest's "
                                      f"{w['sha256'][:16]} (corrupt archive or edited manifest)")
                # another zlib may deflate the same data to other bytes: a new zip of the members, whose
                # contents decide
                path = rebuild(packed, work, fresh=True)[0]
                if content_sha256(path) != w["content_sha256"]:
                    raise WheelsError(f"{packed}: the rebuilt wheel's contents are not the manifest's "
                                      "(corrupt archive or edited manifest)")
                log(f"gpu-wheels: {w['file']}: rebuilt with zlib {zlib.ZLIB_RUNTIME_VERSION} (packed with "
                    f"{layout.get('zlib')}): other deflate bytes, so a new zip of the same contents (checked)")
        else:
            path = os.path.join(src, w["file"])
            if not os.path.exists(path):
                raise WheelsError(f"{path}: missing (listed in {MANIFEST})")
            if sha256_file(path) != w["sha256"]:
                raise WheelsError(f"{path}: sha256 is not the manifest's (corrupt or replaced wheel)")
        paths.append(path)
    return paths


def site_paths(target: str, python: str = sys.executable) -> list[str]:
    """target and the folders its .pth files put on sys.path (site.addsitedir, in a fresh interpreter)."""
    code = ("import json, site, sys; before = list(sys.path); site.addsitedir(sys.argv[1]); "
            "print(json.dumps([p for p in sys.path if p not in before]))")
    r = subprocess.run([python, "-c", code, target], capture_output=True, text=True, timeout=120)
    try:
        extra = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise WheelsError(f"{target}: its .pth files did not load: {(r.stderr.strip().splitlines() or ['?'])[-1]}") \
            from None
    return [target] + [p for p in extra if os.path.abspath(p) != os.path.abspath(target)]


def check_imports(modules, pythonpath: list[str]) -> dict:
    """{module: "ok" or "ErrorType: message"}, each imported in one fresh interpreter on pythonpath."""
    if not modules:
        return {}
    code = ("import importlib, json, sys\nout = {}\nfor m in sys.argv[1:]:\n    try:\n"
            "        importlib.import_module(m)\n        out[m] = 'ok'\n    except BaseException as e:\n"
            "        msg = str(e).splitlines()[0] if str(e) else ''\n"
            "        out[m] = (type(e).__name__ + (': ' + msg if msg else ''))[:240]\n"
            "print(json.dumps(out))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath + [p for p in os.environ.get(
        "PYTHONPATH", "").split(os.pathsep) if p]))
    r = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, timeout=300, env=env)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {m: "the import check crashed: " + ((r.stderr.strip().splitlines() or ["?"])[-1])[:160]
                for m in modules}


def install(src: str, target: str, cross: bool = False, log: Callable[[str], None] = print,
            imports=()) -> dict:
    """Rebuild + check + one pip install into target, then import each of imports there. Returns {packages:
    [name==version], pythonpath: [...], imports: {module: ok or error}, seconds, rebuild_s}. cross: install
    wheels built for the GPU machine's CPython 3.12 here (a plumbing check)."""
    t0 = time.perf_counter()
    manifest = load_manifest(src)
    os.makedirs(target, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as work:
        paths = verified_wheels(src, manifest, work, log)
        rebuild_s = time.perf_counter() - t0
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--upgrade", "--target", target]
        cmd += (CROSS_ARGS if cross else []) + paths
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        err = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.startswith("ERROR")] or \
            (r.stderr + r.stdout).strip().splitlines()[-1:] or ["?"]
        raise WheelsError(f"pip install --target {target} failed: {err[0]}")
    pythonpath = site_paths(target)
    packages = [f"{w['name']}=={w['version']}" for w in manifest["wheels"]]
    return {"packages": packages, "pythonpath": pythonpath, "imports": check_imports(imports, pythonpath),
            "seconds": round(time.perf_counter() - t0, 1), "rebuild_s": round(rebuild_s, 1), "src": src,
            "target": target}


def imports_text(res: dict) -> str:
    return ", ".join(f"{m} {'ok' if v == 'ok' else 'FAILED (' + v + ')'}" for m, v in res.get("imports", {}).items())


def summary_line(res: dict) -> str:
    imports = f"; imports: {imports_text(res)}" if res.get("imports") else ""
    return (f"gpu-wheels: installed {len(res['packages'])} wheels into {res['target']} in {res['seconds']:.1f} s "
            f"(rebuild + checks {res['rebuild_s']:.1f} s): {' '.join(res['packages'])}{imports}; "
            f"export PYTHONPATH={os.pathsep.join(res['pythonpath'])}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("download", "pack"):
        s = sub.add_parser(name, help="fetch requirements-gpu.txt, then pack" if name == "download"
                           else "repack the large wheels in --dest, write manifest.json, check the budget")
        s.add_argument("--dest", default=os.path.join(ROOT, ".whl"))
        s.add_argument("--budget-mib", type=float, default=None, help="the folder's total at most (default: "
                       f"64 MiB less the tree that travels with it, less {TREE_GROWTH_MIB:g} MiB; 56 outside git)")
        s.add_argument("--repack-over-mib", type=float, default=0.0, help="repack the wheels larger than this "
                       "(default 0: all; xz of the files is 40%% smaller than the wheels' deflate, and it is needed)")
        if name == "download":
            s.add_argument("--requirements", default=REQUIREMENTS)
    s = sub.add_parser("install", help="on the GPU machine: rebuild, check, pip install --target")
    s.add_argument("--src", default=os.path.join(ROOT, ".whl"))
    s.add_argument("--target", default="/tmp/site")
    s.add_argument("--cross", action="store_true", help="install CPython 3.12 manylinux wheels with another "
                   "python (pip's --python-version/--platform): a check of the step, not a usable install")
    s.add_argument("--check-imports", default="", metavar="MODULES", help="comma list of modules to import after "
                   "the install (a failure is reported, not fatal); gpu_report.py checks " + ",".join(CHECK_IMPORTS))
    args = p.parse_args(argv)
    if getattr(args, "budget_mib", 0) is None:
        args.budget_mib = default_budget_mib()
    try:
        if args.cmd == "download":
            download(args.dest, args.requirements, args.repack_over_mib, args.budget_mib)
        elif args.cmd == "pack":
            pack(args.dest, args.repack_over_mib, args.budget_mib)
        else:
            imports = [m for m in args.check_imports.split(",") if m]
            print(summary_line(install(args.src, args.target, args.cross, imports=imports)), flush=True)
    except WheelsError as e:
        print(f"gpu-wheels: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
