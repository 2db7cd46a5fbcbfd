"""Regenerate data/pretrain/en_python_docs.jsonl from Python standard-library docstrings.

Docstrings are (c) Python Software Foundation, PSF License. One JSON document per
module: module docstring followed by the docstrings of its public classes,
methods and functions. Output depends slightly on the Python version used.

Usage: python data/tools/extract_stdlib_docs.py [out_path] [max_bytes]
"""
import hashlib
import importlib
import inspect
import json
import os
import sys
import warnings

MODULES = """
abc argparse array ast asyncio base64 bisect bz2 calendar cmath codecs collections
colorsys configparser contextlib copy csv dataclasses datetime decimal difflib dis
email enum filecmp fnmatch fractions ftplib functools gettext glob gzip hashlib heapq
hmac html http.client http.server imaplib inspect io ipaddress itertools json
logging lzma mailbox math mimetypes numbers operator optparse os pathlib pickle
pkgutil platform plistlib poplib pprint queue quopri random re reprlib sched secrets
selectors shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl
statistics string struct subprocess tarfile tempfile textwrap threading timeit
tokenize trace traceback types typing unittest urllib.parse urllib.request uuid
warnings weakref xml.dom.minidom xml.etree.ElementTree zipfile zlib zoneinfo
concurrent.futures multiprocessing graphlib contextvars tracemalloc wave
builtins sys time gc pdb doctest cProfile pstats getopt getpass locale netrc pydoc
runpy site stat symtable sysconfig zipimport zipapp webbrowser wsgiref.simple_server
wsgiref.util xmlrpc.client xmlrpc.server xml.sax html.parser http.cookies http.cookiejar
email.message email.utils email.parser email.headerregistry unittest.mock importlib
importlib.resources importlib.metadata keyword linecache code codeop compileall
py_compile pyclbr mmap errno faulthandler atexit bdb binascii cgitb chunk cmd
curses.ascii encodings.idna fileinput ctypes asyncio.tasks asyncio.queues asyncio.locks
asyncio.streams asyncio.subprocess urllib.robotparser urllib.error http.cookies
""".split()

MIN_DOC = 40  # characters; skip trivially short docstrings


def clean(doc):
    return inspect.cleandoc(doc).strip() if doc else ""


SEEN_DOCS = set()  # global: a docstring re-exported by several modules is kept once


def module_text(name):
    mod = importlib.import_module(name)
    parts, seen = [], SEEN_DOCS

    def add(header, doc):
        doc = clean(doc)
        if len(doc) < MIN_DOC:
            return
        h = hashlib.md5(doc.encode()).hexdigest()
        if h in seen:
            return
        seen.add(h)
        parts.append(f"{header}\n\n{doc}" if header else doc)

    parts.append(f"Module {name}")
    add("", mod.__doc__)
    public = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
    for attr in sorted(set(public)):
        obj = getattr(mod, attr, None)
        if obj is None or getattr(obj, "__module__", None) is None:
            continue
        if not str(obj.__module__).startswith(name.split(".")[0]):
            continue  # re-exported from elsewhere
        if inspect.isclass(obj):
            add(f"class {name}.{attr}", obj.__doc__)
            for mname, meth in sorted(vars(obj).items()):
                if mname.startswith("_") or not callable(meth):
                    continue
                add(f"{name}.{attr}.{mname}", getattr(meth, "__doc__", None))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            add(f"{name}.{attr}", obj.__doc__)
    return "\n\n".join(parts) if len(parts) > 1 else ""


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "pretrain", "en_python_docs.jsonl")
    max_bytes = int(sys.argv[2]) if len(sys.argv) > 2 else 1_100_000
    warnings.simplefilter("ignore")
    total, n, seen = 0, 0, set()
    with open(out, "w", encoding="utf-8") as f:
        for name in MODULES:
            try:
                text = module_text(name)
            except Exception as e:  # module missing on this platform
                print(f"skip {name}: {e}", file=sys.stderr)
                continue
            if len(text) < 300 or text in seen:
                continue
            seen.add(text)
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            if total + len(line.encode()) > max_bytes:
                continue
            f.write(line)
            total += len(line.encode())
            n += 1
    print(f"wrote {n} documents, {total} bytes -> {out}")


if __name__ == "__main__":
    main()
