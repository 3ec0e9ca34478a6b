"""How long a state digest holds the other threads (the event loop) while it hashes a 2M-row table's worth of
tensors (256 MB): the bytes copied first (``tobytes``, the GIL held through the copy) against fed through their
buffer (``hash_tensor``: hashlib reads with the GIL released).  The longest gap a 1 ms ticker thread sees.

    PYTHONPATH=$PWD python docs/bench/engine/digest_stall.py
"""
import threading, time, hashlib, torch
from psserver.protocol.rows.table import hash_tensor
t = torch.randn(2_000_000, 32)  # 256 MB: a 2M-row table's rows and state of dim 16
def measure(fn):
    gaps, done = [], threading.Event()
    def ticker():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter(); gaps.append(now - last); last = now
    th = threading.Thread(target=ticker); th.start()
    time.sleep(0.05)
    fn(); done.set(); th.join()
    return max(gaps)
for name, fn in (("tobytes", lambda: hashlib.sha256().update(t.numpy().tobytes())),
                 ("buffer", lambda: hash_tensor(hashlib.sha256(), t))) * 2:
    print(name, "longest gap of a 1 ms ticker: %.0f ms" % (1000 * measure(fn)))
