#!/usr/bin/env bash
# The first stage of tests/gpu/run.sh: what this machine is, in seconds, every command bounded.
#   probe.sh BINARY...    (the binaries whose libraries to resolve)
export LC_ALL=C
t() { timeout -k 2 "$@"; }
echo "== machine =="
uname -srmv
t 5 cat /proc/version
grep -hE '^(PRETTY_NAME)=' /etc/os-release 2>/dev/null
echo "cpus $(nproc), memory $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo)"
# gVisor reports a 4.4.0 kernel and names itself in dmesg; Firecracker shows in the DMI/cpuinfo.
t 5 dmesg 2>/dev/null | grep -m1 -oiE 'gvisor|firecracker|nvproxy' | sed 's/^/sandbox: /' || true
t 5 df -h /dev/shm | tail -1 | awk '{print "/dev/shm " $2 " (" $4 " free)"}'
echo "== GPU =="
if command -v nvidia-smi >/dev/null; then
  t 20 nvidia-smi --query-gpu=name,driver_version,compute_mode,mig.mode.current,memory.total,pci.bus_id \
    --format=csv 2>&1 | head -5
  t 20 nvidia-smi -q 2>/dev/null | grep -m3 -E 'CUDA Version|Persistence Mode|Virtualization Mode'
else
  echo "nvidia-smi: not found"
fi
ls /dev/nvidia* 2>&1 | tr '\n' ' '
echo
# run.sh gives the binaries their library path in GRADSYNC_BIN_LD_LIBRARY_PATH (never Python).
bin_path=${GRADSYNC_BIN_LD_LIBRARY_PATH-${LD_LIBRARY_PATH:-}}
echo "== libraries the binaries resolve (LD_LIBRARY_PATH=$bin_path) =="
for b in "$@"; do
  [[ -x $b ]] || { echo "$(basename "$b"): missing"; continue; }
  [[ $(head -c4 "$b" | tail -c3) == ELF ]] || { echo "$(basename "$b"): not an ELF binary"; continue; }
  found=$(LD_LIBRARY_PATH=$bin_path t 10 ldd "$b" 2>&1 | grep -E 'not found|libcudart|libnccl|libcuda\.' |
    awk '{print $1 " -> " $3}' | paste -sd' ' -)
  echo "$(basename "$b"): ${found:-no CUDA or NCCL library, nothing missing}"
done
echo "== python, torch, CUDA, NCCL =="
t 40 python3 - <<'PY' 2>&1 | tail -3
import sys
print("python", sys.version.split()[0])
try:
    import torch
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    print("torch", torch.__version__, "cuda", torch.version.cuda, "available",
          torch.cuda.is_available(), "nccl", nccl)
except Exception as e:  # no torch here, or a broken one: say so
    print("torch: not usable:", type(e).__name__, e)
PY
echo "== torch probe =="
t 45 python3 "$(dirname "$0")/torch_probe.py" 2>&1 | tail -3
exit 0
