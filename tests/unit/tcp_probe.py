"""A TCP sink and a sender, run inside network namespaces by test_testcluster_shaping.py.

``python tcp_probe.py serve ADDR PORT``: accept connections one after another, read each to
its end, answer one byte; prints ``ready`` once listening.
``python tcp_probe.py send ADDR PORT NBYTES``: connect, send NBYTES, wait for the answer;
prints JSON ``{"connect_s", "transfer_s", "mbit_s"}``. The connect time is one round trip
(SYN out, SYN-ACK back), so it grows with a delay on either side's egress.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20


def serve(addr: str, port: int) -> None:
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((addr, port))
        server.listen(8)
        print("ready", flush=True)
        while True:
            conn, _ = server.accept()
            with conn:
                while conn.recv(CHUNK):
                    pass
                conn.sendall(b"k")


def send(addr: str, port: int, nbytes: int) -> dict[str, float]:
    started = time.perf_counter()
    with socket.create_connection((addr, port), timeout=30) as conn:
        connected = time.perf_counter()
        block, left = b"x" * CHUNK, nbytes
        while left > 0:
            conn.sendall(block[:left])
            left -= CHUNK
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)
        done = time.perf_counter()
    return {"connect_s": connected - started, "transfer_s": done - connected,
            "mbit_s": nbytes * 8 / (done - connected) / 1e6}


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
