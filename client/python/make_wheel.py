"""Packs the built gradsync package (pure Python plus libgradsync_c.so) into a wheel.

    make_wheel.py --package BUILD/python/gradsync --out BUILD/python/dist --version 0.1.0 \
        [--dist_info BUILD/python/gradsync-0.1.0.dist-info]

--dist_info also writes the package's metadata (METADATA, entry_points.txt) into that folder,
beside the package, so that the package laid out in BUILD/python (PYTHONPATH) and installed
from it (the Debian package) has what the wheel has: the entry point through which torch 2.x
finds the backend "gradsync" when a script names it without importing gradsync.torch.

The wheel is tagged py3-none-<platform>: the Python files run in any CPython 3.9+ and the
library is loaded with ctypes, so nothing in it depends on the interpreter's ABI. It links the
machine's gRPC, protobuf and Abseil (Debian's), which the target machine must have. Standard
library only; the output is reproducible (fixed timestamps, sorted entries).
"""
import argparse
import base64
import hashlib
import os
import sysconfig
import zipfile

SUMMARY = "gradsync client: collectives through the node's gradsyncd, and gradsync.torch"
# torch.distributed looks up a backend it does not know among these entry points (torch >= 2.x's
# Backend._ensure_backend_registered) and calls the registrar.
ENTRY_POINTS = "[torch.distributed.backends]\ngradsync = gradsync.torch:register_backend\n"


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", required=True, help="the built package folder (gradsync/)")
    ap.add_argument("--out", required=True, help="folder for the wheel")
    ap.add_argument("--version", required=True)
    ap.add_argument("--dist_info", help="also write METADATA and entry_points.txt here")
    args = ap.parse_args()
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    tag = f"py3-none-{platform}"
    info = f"gradsync-{args.version}.dist-info"
    files = {}
    for name in sorted(os.listdir(args.package)):
        if name.endswith(".py") or name.endswith(".so"):
            with open(os.path.join(args.package, name), "rb") as f:
                files[f"gradsync/{name}"] = f.read()
    files[f"{info}/METADATA"] = (
        "Metadata-Version: 2.1\nName: gradsync\n"
        f"Version: {args.version}\nSummary: {SUMMARY}\nRequires-Python: >=3.9\n"
        "Provides-Extra: torch\nRequires-Dist: torch; extra == \"torch\"\n").encode()
    files[f"{info}/entry_points.txt"] = ENTRY_POINTS.encode()
    if args.dist_info:
        os.makedirs(args.dist_info, exist_ok=True)
        for name in ("METADATA", "entry_points.txt"):
            with open(os.path.join(args.dist_info, name), "wb") as f:
                f.write(files[f"{info}/{name}"])
    files[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: gradsync make_wheel.py\nRoot-Is-Purelib: false\n"
        f"Tag: {tag}\n").encode()
    record = [record_line(n, d) for n, d in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    os.makedirs(args.out, exist_ok=True)
    for old in os.listdir(args.out):
        if old.endswith(".whl"):
            os.remove(os.path.join(args.out, old))
    path = os.path.join(args.out, f"gradsync-{args.version}-{tag}.whl")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            entry = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(entry, data)
    print(path)


if __name__ == "__main__":
    main()
