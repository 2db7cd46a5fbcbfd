"""scripts/gpu_wheels.py on tiny wheels built here (no network): a repacked wheel is rebuilt byte for byte (its
sha256), the install imports the modules (a .pth's folder too, as nvidia-cutlass-dsl's `cutlass` needs), a
corrupt archive or a manifest that does not match is a one-line error naming the file, the budget check names the
largest file; and gpu_report.py's --wheels puts the extras on every stage's PYTHONPATH."""
import base64
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import zipfile
import zlib

import pytest

from scripts import gpu_wheels as gw
from tests.conftest import PY, ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu_wheels.py")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(folder, dist: str, version: str, files: dict, levels: dict = None, stored=()) -> str:
    """A py3-none-any wheel holding files (name -> bytes), with METADATA, WHEEL and RECORD; members deflated at
    zlib's default level unless levels names another, or stored."""
    di = f"{dist}-{version}.dist-info"
    files = dict(files)
    files[f"{di}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n".encode()
    files[f"{di}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{di}/RECORD"] = ("\n".join(_record_line(n, d) for n, d in files.items()) + f"\n{di}/RECORD,,\n").encode()
    path = os.path.join(folder, f"{dist}-{version}-py3-none-any.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 2, 3, 4, 6))
            info.external_attr = 0o644 << 16
            if name in stored:
                z.writestr(info, data, compress_type=zipfile.ZIP_STORED)
            else:
                z.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=(levels or {}).get(name))
    return path


def _payload(n: int, seed: int = 0) -> bytes:
    rnd = random.Random(seed)  # compressible but not trivial: words from a small vocabulary
    words = [bytes(rnd.choices(b"abcdefghij_", k=rnd.randint(2, 9))) for _ in range(200)]
    return b" ".join(rnd.choice(words) for _ in range(n // 6))[:n]


@pytest.fixture
def wheels(tmp_path):
    """.whl-like folder: tinya (large enough to repack: a .pth adding a folder, a level-9 member, a stored member)
    and tinyb (kept as a wheel)."""
    src = tmp_path / "whl"
    src.mkdir()
    a = make_wheel(src, "tinya", "1.2.3", {
        "tinya/__init__.py": b"VALUE = 42\n",
        "tinya/data.bin": _payload(300_000),
        "tinya/nine.txt": _payload(50_000, seed=1),
        "tinya/raw.bin": bytes(random.Random(2).getrandbits(8) for _ in range(5000)),
        "tinya/pkgs/tinya_inner/__init__.py": b"INNER = 'found through the .pth'\n",
        "tinya_paths.pth": b"import sys, os, tinya; sys.path.insert(0, os.path.join(tinya.__path__[0], 'pkgs'))\n",
    }, levels={"tinya/nine.txt": 9}, stored=("tinya/raw.bin",))
    b = make_wheel(src, "tinyb", "0.1", {"tinyb.py": b"NAME = 'b'\n"})
    return src, a, b


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_repacked_wheel_rebuilds_byte_for_byte(wheels, tmp_path):
    src, a, _ = wheels
    sha = _sha(a)
    layout = gw.repack(a, str(tmp_path / "a.tar.xz"))
    cuts = {c["name"]: c for c in layout["cuts"]}
    assert cuts["tinya/nine.txt"]["level"] == 9 and cuts["tinya/data.bin"]["level"] == 6
    assert cuts["tinya/raw.bin"]["method"] == "stored"
    out = tmp_path / "out"
    out.mkdir()
    path, digest, _ = gw.rebuild(str(tmp_path / "a.tar.xz"), str(out))
    assert digest == sha == _sha(path) and os.path.basename(path) == os.path.basename(a)


def test_a_member_zlib_does_not_reproduce_stays_in_the_skeleton(tmp_path, monkeypatch):
    real = zipfile._get_compressor
    # Huffman-only deflate: valid, but no zlib level writes it, so the repack keeps its bytes as they are
    monkeypatch.setattr(zipfile, "_get_compressor", lambda ct, lvl=None: zlib.compressobj(
        6, zlib.DEFLATED, -15, 8, zlib.Z_HUFFMAN_ONLY) if ct == zipfile.ZIP_DEFLATED else real(ct, lvl))
    a = make_wheel(tmp_path, "odd", "1", {"odd/__init__.py": _payload(20_000)})
    monkeypatch.setattr(zipfile, "_get_compressor", real)
    layout = gw.repack(a, str(tmp_path / "odd.tar.xz"))
    assert "odd/__init__.py" not in {c["name"] for c in layout["cuts"]}
    (tmp_path / "o").mkdir()
    assert gw.rebuild(str(tmp_path / "odd.tar.xz"), str(tmp_path / "o"))[1] == _sha(a)


def _run(*args):
    return subprocess.run([PY, SCRIPT, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_pack_then_install_imports_the_modules(wheels, tmp_path):
    src, a, b = wheels
    sha_a, size_a = _sha(a), os.path.getsize(a)
    r = _run("pack", "--dest", str(src), "--repack-over-mib", str(size_a / 2**20 / 2))
    assert r.returncode == 0, r.stderr
    names = sorted(os.listdir(src))
    assert names == ["manifest.json", os.path.basename(a) + ".tar.xz", os.path.basename(b)], names
    man = json.loads((src / "manifest.json").read_text())
    wa = next(w for w in man["wheels"] if w["name"] == "tinya")
    assert (wa["version"], wa["sha256"], wa["size"]) == ("1.2.3", sha_a, size_a)
    assert wa["packed_size"] == os.path.getsize(src / wa["packed"]) < size_a
    target = tmp_path / "site"
    r = _run("install", "--src", str(src), "--target", str(target), "--check-imports", "tinya_inner,nosuchmod")
    assert r.returncode == 0, r.stderr
    line = r.stdout.strip().splitlines()[-1]
    assert "tinya==1.2.3" in line and "tinyb==0.1" in line
    assert "imports: tinya_inner ok, nosuchmod FAILED (ModuleNotFoundError" in line
    pythonpath = line.split("export PYTHONPATH=", 1)[1]
    assert pythonpath.split(os.pathsep) == [str(target), os.path.join(str(target), "tinya", "pkgs")]
    code = "import tinya, tinyb, tinya_inner; print(tinya.VALUE, tinyb.NAME, tinya_inner.INNER)"
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=str(tmp_path), timeout=60,
                       env=dict(os.environ, PYTHONPATH=pythonpath))
    assert r.stdout.strip() == "42 b found through the .pth", r.stderr


def _packed(wheels):
    src, a, _ = wheels
    gw.pack(str(src), repack_over_mib=os.path.getsize(a) / 2**20 / 2, log=lambda m: None)
    return src, str(src / (os.path.basename(a) + ".tar.xz"))


def _one_line_error(r, name):
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and name in lines[0] and lines[0].startswith("gpu-wheels: "), r.stderr
    return lines[0]


def test_a_corrupt_or_truncated_archive_is_a_one_line_error_naming_it(wheels, tmp_path):
    src, packed = _packed(wheels)
    blob = bytearray(open(packed, "rb").read())
    blob[len(blob) // 2] ^= 0xFF
    open(packed, "wb").write(bytes(blob))
    _one_line_error(_run("install", "--src", str(src), "--target", str(tmp_path / "s")), os.path.basename(packed))
    open(packed, "wb").write(bytes(blob[: len(blob) // 3]))
    _one_line_error(_run("install", "--src", str(src), "--target", str(tmp_path / "s")), os.path.basename(packed))
    assert not (tmp_path / "s" / "tinyb.py").exists()  # nothing installed


def test_a_manifest_that_does_not_match_is_a_one_line_error_naming_the_file(wheels, tmp_path):
    src, packed = _packed(wheels)
    man_path = src / "manifest.json"
    good = man_path.read_text()
    for dist, name in (("tinya", os.path.basename(packed)), ("tinyb", "tinyb-0.1-py3-none-any.whl")):
        man = json.loads(good)
        next(w for w in man["wheels"] if w["name"] == dist)["sha256"] = "0" * 64
        man_path.write_text(json.dumps(man))
        line = _one_line_error(_run("install", "--src", str(src), "--target", str(tmp_path / "s")), name)
        assert "sha256" in line
    man_path.write_text(good)
    make_wheel(src, "stray", "9", {"stray.py": b""})
    _one_line_error(_run("install", "--src", str(src), "--target", str(tmp_path / "s")), "stray-9-py3-none-any.whl")


def test_another_zlib_is_checked_by_the_wheels_contents(wheels, tmp_path, monkeypatch):
    """On a machine whose zlib deflates differently the rebuilt bytes differ: the members' contents decide."""
    src, packed = _packed(wheels)
    monkeypatch.setattr(zlib, "ZLIB_RUNTIME_VERSION", "0.0-other")
    real = gw._deflate
    monkeypatch.setattr(gw, "_deflate", lambda data, level, mem: real(data, 1, mem))
    notes = []
    (tmp_path / "w").mkdir()
    paths = gw.verified_wheels(str(src), gw.load_manifest(str(src)), str(tmp_path / "w"), notes.append)
    assert len(paths) == 2 and "a new zip of the same contents" in notes[0], notes
    with zipfile.ZipFile(paths[0]) as z:
        assert z.testzip() is None and z.read("tinya/__init__.py") == b"VALUE = 42\n"
    man = json.loads((src / "manifest.json").read_text())
    next(w for w in man["wheels"] if w["name"] == "tinya")["content_sha256"] = "0" * 64
    (src / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(gw.WheelsError, match=os.path.basename(packed) + ": the rebuilt wheel's contents"):
        gw.verified_wheels(str(src), gw.load_manifest(str(src)), str(tmp_path / "w"), notes.append)


def test_over_the_budget_is_a_one_line_error_naming_the_largest_file(wheels):
    src, a, _ = wheels
    r = _run("pack", "--dest", str(src), "--budget-mib", "0.01", "--repack-over-mib", "100")
    line = _one_line_error(r, os.path.basename(a))
    assert "over the 0.01 MiB carry budget" in line and line.index(os.path.basename(a)) < line.index("tinyb")


def test_the_requirements_are_pinned_and_a_bad_line_names_itself(tmp_path):
    reqs = dict(gw.read_requirements())
    for name in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13", "quack-kernels", "torchtitan",
                 "liger-kernel", "torchao"):
        assert name in reqs
    assert reqs["flash-attn-4"] == "4.0.0b36"
    # what the GPU runs is what the CPU tests check: torchtitan (and its torchdata, tyro) as requirements-peers.txt
    # pins them, torchao as requirements-dev.txt does
    here = {}
    for f in ("requirements-peers.txt", "requirements-dev.txt"):
        with open(os.path.join(gw.ROOT, f), encoding="utf-8") as fh:
            here.update(m.groups() for m in (re.match(r"([A-Za-z0-9._-]+)==([^\s;#]+)", ln) for ln in fh) if m)
    for name in ("torchtitan", "torchdata", "tyro", "torchao"):
        assert reqs[name] == here[name], (name, reqs[name], here[name])
    assert not {"torch", "triton"} & {gw.canonical(n) for n in reqs}
    bad = tmp_path / "r.txt"
    bad.write_text("# ok\nliger-kernel>=0.8\n")
    with pytest.raises(gw.WheelsError, match=r"r.txt:2: 'liger-kernel>=0.8' is not name==version"):
        gw.read_requirements(str(bad))
    cmd = gw.pip_download_cmd("/d", ["x==1"])
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--no-deps" in cmd


def test_the_report_installs_the_wheels_and_puts_them_on_every_stage_path(wheels, tmp_path, monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_report_wheels", os.path.join(ROOT, "scripts", "gpu_report.py"))
    gr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gr)
    src, _ = _packed(wheels)
    monkeypatch.setattr(gw, "CHECK_IMPORTS", ("tinya_inner",))
    monkeypatch.setenv("PYTHONPATH", "/already/there")
    monkeypatch.setattr(sys, "path", list(sys.path))
    args = gr.argparse.Namespace(wheels=str(src), dry_run_cpu=True, work_dir=str(tmp_path / "work"))
    extras = gr.install_wheels(args, gr.Log(None))
    site = str(tmp_path / "work" / "site")
    assert extras["extras"].startswith("2 from ") and "tinya==1.2.3, tinyb==0.1; imports: tinya_inner ok" in \
        extras["extras"]
    env = gr.child_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [site, os.path.join(site, "tinya", "pkgs"), "/already/there"]
    assert sys.path[1] == site
    args.wheels = None  # a dry run takes no wheels unless given; a broken folder is logged, not fatal
    assert gr.install_wheels(args, gr.Log(None)) == {}
    args.wheels = str(tmp_path / "nowhere")
    assert gr.install_wheels(args, gr.Log(None))["extras"].startswith("install failed: ")
