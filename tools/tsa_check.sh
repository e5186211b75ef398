#!/usr/bin/env bash
# Clang's lock checker (-Wthread-safety) on our C++ sources, fast: each file is parsed with the
# flags the build used (BUILD_DIR's compile_commands.json, default ./build), nothing is built.
#
#   tools/tsa_check.sh                 every .cc of daemon/, client/, common/, net/ in the build
#   tools/tsa_check.sh FILE.cc ...     just these
# Exits non-zero when clang warns about a lock rule (or cannot parse a file).
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")/.."
build_dir=${BUILD_DIR:-build}
command -v clang++ >/dev/null || { echo "tsa_check: no clang++" >&2; exit 77; }
exec python3 - "$build_dir" "$@" <<'PY'
import json, os, shlex, subprocess, sys
build, files = sys.argv[1], [os.path.abspath(f) for f in sys.argv[2:]]
db = json.load(open(os.path.join(build, "compile_commands.json")))
root = os.getcwd()
ours = tuple(os.path.join(root, d) + "/" for d in ("daemon", "client", "common", "net"))
entries = [e for e in db if e["file"].endswith(".cc") and
           (e["file"] in files if files else e["file"].startswith(ours))]
missing = set(files) - {e["file"] for e in entries}
if missing:
    sys.exit("tsa_check: not in %s/compile_commands.json: %s" % (build, " ".join(sorted(missing))))
failed = 0
for e in entries:
    args = shlex.split(e["command"]) if "command" in e else e["arguments"]
    keep, skip = [], False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in ("-o", "-c"):
            skip = True
            continue
        keep.append(a)
    cmd = ["clang++"] + [a for a in keep if a != e["file"]] + [
        "-fsyntax-only", "-Wno-unknown-warning-option", "-Wthread-safety",
        "-Werror=thread-safety", e["file"]]
    r = subprocess.run(cmd, cwd=e["directory"], capture_output=True, text=True)
    if r.returncode != 0:
        failed += 1
        sys.stdout.write(r.stderr)
print("tsa_check: %d file(s), %d with lock-rule errors" % (len(entries), failed))
sys.exit(1 if failed else 0)
PY
