"""What this machine allows a trainer: a CUDA tensor and an interprocess CUDA event shared with a
child process (torch.multiprocessing), as gradsync's trainers share buffers with the daemon.
Prints one line; exit 0 unless the sharing itself failed."""
import sys, time

try:
    import torch
    import torch.multiprocessing as mp
except ImportError as e:
    sys.exit(print(f"torch probe: no torch here ({e})") or 0)


def child(t, ready, q):
    torch.cuda.current_stream().wait_event(ready)  # the parent's write, stream-ordered
    t.add_(1)
    torch.cuda.synchronize()
    q.put(float(t.sum()))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit(print(f"torch probe: torch {torch.__version__} sees no CUDA device") or 0)
    mp.set_start_method("spawn")
    t, ready, q = torch.zeros(1 << 20, device="cuda"), torch.cuda.Event(interprocess=True), mp.Queue()
    t.fill_(2), ready.record()
    start, p = time.time(), mp.Process(target=child, args=(t, ready, q))
    p.start(), p.join(30)
    got = q.get(timeout=5) if p.exitcode == 0 else None
    ok = got == 3.0 * (1 << 20) and t[0].item() == 3.0
    print(f"torch probe: shared tensor + IPC event {'OK' if ok else 'FAILED'}: child exit "
          f"{p.exitcode}, child saw sum {got}, parent sees {t[0].item()} ({time.time() - start:.1f} s)")
    sys.exit(0 if ok else 1)
