"""The floor under issue 12's fresh-wait bar: per-slice messages on raw sockets.

``pw.wait`` over Arrays just put on k slices costs one message out and one back per
slice. This measures the cheapest form such messages can take in Python, with no gRPC
and no pathways_torch: k+1 TCP connections on loopback to one server process that
answers on one selector thread, a client that writes each message from the calling
thread and reads the answers on one selector thread (no thread per stream, no queue).
In each round, ``per`` put-then-wait rounds over 1 connection and over 64 alternate
(A, B, then B, A), and the round's ratio is the median wait over 64 over the median
over 1. Two ways to ask for completion:

- ``ask``: the wait sends a watch on every connection that has work outstanding;
- ``tail``: each put carries the watch (the answers come back while the puts are
  still being written), so the wait only waits.

The bar (64 slices at most 3x one) needs a per-slice cost of about 3/64 of a round
trip; this prints what a round trip and a slice cost on this machine.

    python bench/wait_floor.py [--rounds 7] [--per 5] [--slices 64]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import selectors
import socket
import statistics
import struct
import threading
import time

from common import emit, ratio_summary

FRAME = struct.Struct("<II")         # kind (0 a put, 1 a watch, 2 an answer), count
PUT, WATCH, DONE = 0, 1, 2


def _serve(port_q, n: int) -> None:
    """Count every connection's frames; answer each watch with the count so far."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(n)
    port_q.put(listener.getsockname()[1])
    sel = selectors.DefaultSelector()
    for _ in range(n):
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sel.register(conn, selectors.EVENT_READ, [b"", 0])
    while True:
        for key, _ in sel.select():
            state = key.data
            data = key.fileobj.recv(65536)
            if not data:
                return
            buf, out = state[0] + data, []
            while len(buf) >= FRAME.size:
                kind, _ = FRAME.unpack_from(buf)
                buf = buf[FRAME.size:]
                state[1] += 1
                if kind == WATCH:
                    out.append(FRAME.pack(DONE, state[1]))
            state[0] = buf
            if out:
                key.fileobj.sendall(b"".join(out))


class _Client:
    def __init__(self, port: int, n: int) -> None:
        self.socks = []
        for _ in range(n):
            s = socket.create_connection(("127.0.0.1", port))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.socks.append(s)
        self.sent, self.done = [0] * n, [0] * n
        self.cond = threading.Condition()
        self.sel = selectors.DefaultSelector()
        for i, s in enumerate(self.socks):
            self.sel.register(s, selectors.EVENT_READ, i)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            for key, _ in self.sel.select():
                data = key.fileobj.recv(65536)
                if not data:
                    return
                last = FRAME.unpack_from(data, len(data) - FRAME.size)[1]
                with self.cond:
                    self.done[key.data] = max(self.done[key.data], last)
                    self.cond.notify_all()

    def put(self, i: int, tail: bool) -> None:
        msg = FRAME.pack(PUT, 0) + (FRAME.pack(WATCH, 0) if tail else b"")
        self.sent[i] += 2 if tail else 1
        self.socks[i].sendall(msg)

    def wait(self, idx, ask: bool) -> None:
        if ask:
            for i in idx:
                if self.done[i] < self.sent[i]:
                    self.sent[i] += 1
                    self.socks[i].sendall(FRAME.pack(WATCH, 0))
        with self.cond:
            self.cond.wait_for(lambda: all(self.done[i] >= self.sent[i] for i in idx))


def measure(client: _Client, k: int, mode: str, rounds: int, per: int) -> dict:
    one, many = [0], list(range(1, k + 1))
    ratios, t1s, tks = [], [], []
    for r in range(rounds):
        t = {}
        for name, idx in (("1", one), ("k", many)) if r % 2 == 0 else (("k", many), ("1", one)):
            ts = []
            for _ in range(per):
                for i in idx:
                    client.put(i, tail=mode == "tail")
                t0 = time.perf_counter()
                client.wait(idx, ask=mode == "ask")
                ts.append(time.perf_counter() - t0)
            t[name] = statistics.median(ts)
        ratios.append(t["k"] / t["1"])
        t1s.append(t["1"] * 1e3)
        tks.append(t["k"] * 1e3)
    return {"ratio": ratio_summary(ratios), "wait_1_ms": round(statistics.median(t1s), 4),
            "wait_k_ms": round(statistics.median(tks), 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--per", type=int, default=5)
    ap.add_argument("--slices", type=int, default=64)
    args = ap.parse_args()
    n = args.slices + 1
    port_q = mp.get_context("spawn").Queue()
    server = mp.get_context("spawn").Process(target=_serve, args=(port_q, n), daemon=True)
    server.start()
    try:
        client = _Client(port_q.get(timeout=30), n)
        out = {"benchmark": "wait_floor", "slices": args.slices}
        for mode in ("ask", "tail"):
            out[mode] = measure(client, args.slices, mode, args.rounds, args.per)
        emit(out)
    finally:
        server.terminate()
        server.join(5)


if __name__ == "__main__":
    main()
