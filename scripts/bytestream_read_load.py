#!/usr/bin/env python3
"""ByteStream read load from a client that is not gantry's own: grpcio (gRPC's C core).

Uploads COUNT random blobs of SIZE bytes to a REAPI server, then reads them all back
ROUNDS times with CONCURRENCY threads, and prints MiB/s per round. With
--server-pid it also prints the server's CPU seconds per GiB read (from /proc), and
always its own, so a run shows how much of the machine each side took: on a small
machine the client's share bounds what any server can reach.

The messages are encoded here by hand (a ReadRequest is a string and two integers), so
the only dependency is grpcio: `python3 -m venv v && v/bin/pip install grpcio`.

    v/bin/python scripts/bytestream_read_load.py 127.0.0.1:8980 --count 16 --size 64MiB
"""
import argparse
import hashlib
import os
import threading
import time
import uuid

import grpc


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_bytes(number, data):
    return varint(number << 3 | 2) + varint(len(data)) + data


def field_int(number, value):
    return varint(number << 3) + varint(value) if value else b""


def read_request(name):
    return field_bytes(1, name.encode())


def write_request(name, offset, finish, data):
    return (field_bytes(1, name.encode()) if name else b"") + field_int(2, offset) + field_int(3, int(finish)) + field_bytes(10, data)


def response_data_len(msg):
    """Length of ReadResponse.data (field 10) in an encoded message."""
    if not msg:
        return 0
    assert msg[0] == (10 << 3 | 2), msg[:4]
    n, shift, i = 0, 0, 1
    while True:
        b = msg[i]
        n |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return n
        shift += 7


def size_arg(s):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if s.endswith(u):
            return int(s[: -len(u)]) * m
    return int(s)


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", help="HOST:PORT of the server (plaintext)")
    p.add_argument("--instance", default="", help="instance name prefix")
    p.add_argument("--count", type=int, default=16)
    p.add_argument("--size", type=size_arg, default=64 << 20)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-pid", type=int, help="report this process's CPU per GiB read")
    a = p.parse_args()
    prefix = a.instance + "/" if a.instance else ""
    channel = grpc.insecure_channel(a.target, options=[("grpc.max_receive_message_length", 64 << 20)])
    identity = lambda b: b  # noqa: E731
    write = channel.stream_unary("/google.bytestream.ByteStream/Write", request_serializer=identity, response_deserializer=identity)
    read = channel.unary_stream("/google.bytestream.ByteStream/Read", request_serializer=identity, response_deserializer=identity)

    names = []
    for _ in range(a.count):
        data = os.urandom(a.size)
        h = hashlib.sha256(data).hexdigest()
        upload = f"{prefix}uploads/{uuid.uuid4()}/blobs/{h}/{a.size}"
        step = 1 << 20
        write(iter([write_request(upload if off == 0 else "", off, off + step >= a.size, data[off:off + step]) for off in range(0, a.size, step)]))
        names.append(f"{prefix}blobs/{h}/{a.size}")

    for rnd in range(a.rounds):
        queue, totals = list(names), []

        def reader():
            n = 0
            while True:
                try:
                    name = queue.pop()
                except IndexError:
                    break
                for msg in read(read_request(name)):
                    n += response_data_len(msg)
            totals.append(n)

        server0 = cpu_seconds(a.server_pid) if a.server_pid else 0.0
        t0 = os.times()
        start = time.perf_counter()
        threads = [threading.Thread(target=reader) for _ in range(a.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        t1 = os.times()
        total = sum(totals)
        if total != a.count * a.size:
            raise SystemExit(f"read {total} bytes, expected {a.count * a.size}")
        gib = total / (1 << 30)
        line = f"round {rnd}: {total / elapsed / (1 << 20):.0f} MiB/s, client CPU {(t1.user + t1.system - t0.user - t0.system) / gib:.2f} s/GiB"
        if a.server_pid:
            line += f", server CPU {(cpu_seconds(a.server_pid) - server0) / gib:.2f} s/GiB"
        print(line + f" ({a.count} x {a.size >> 20} MiB, concurrency {a.concurrency})", flush=True)


if __name__ == "__main__":
    main()
