# Sourced by tests/gpu/run.sh (and its tests): what kind of machine the GPU run is on, from what
# the probe saw, and which GPU features cannot work there.
#   gpu_sandbox KERNEL_LINE DMESG    prints "gvisor" or "vm" (a full VM or bare metal)
#   gpu_sandbox_limits KIND          one line per GPU feature that cannot work on KIND
# gVisor (runsc) is a user-space kernel: it reports Linux 4.4.0 whatever the host runs, names
# itself in its dmesg, and reaches the GPU through nvproxy, which passes a qualified subset of
# the driver's ioctls. A full VM runs NVIDIA's own kernel module: every feature can work.
gpu_sandbox() {
  local kernel=$1 dmesg=${2:-}
  if [[ $dmesg == *[gG][vV]isor* || $kernel =~ ^Linux\ 4\.4\.0[\ ] ]]; then
    echo gvisor
  else
    echo vm
  fi
}

gpu_sandbox_limits() {
  [[ $1 == gvisor ]] || return 0
  echo "MPS: nvidia-cuda-mps-control cannot start a server through nvproxy; the overlap bench runs without MPS only"
  echo "NCCL's cuMem buffers (NCCL_CUMEM_ENABLE=0 is set) and NVLink SHARP/multi-node NVLink: not passed by nvproxy"
  echo "MIG: not supported by nvproxy"
  echo "CUDA IPC between processes: only if the probe's IPC event check passed"
}
