"""A guest process racing the agent for the shim's dial-back port never gets a user's
connection: the shim pairs a dial-back only with the request whose nonce it presents first.

The racer runs in the guest's namespaces (as the agent does: net, uts, ipc) and connects to
the dial-back port over and over — with a guessed nonce, or with none — while users' port-forward
connections go through the same pool. Every user connection must echo exactly what it sent,
the racer must read nothing, and the shim must count and close every stray connection it
accepts.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from runtime_e2e_support import Pods, RuntimeDaemon, read_all
from sandbox_support import port_forward, run_dir, run_pod, shim_stats

from podgate.cri import api_pb2_grpc as pb_grpc
from podgate.streaming.client import PortForwardSession

pytestmark = [
    pytest.mark.privileged,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: sandboxes are made of namespaces"),
]

ECHO_PORT = 7301
RACE_ATTEMPTS = 1000
# Bound on the whole race, seconds (the racer stops at RACE_ATTEMPTS or at this).
RACE_SECONDS = 180.0
# Bound on one user connection's echo, seconds.
ECHO_TIMEOUT_SECONDS = 30.0

# Connects to every dial-back port of the sandbox until `attempts` connections were made;
# odd attempts send a guessed 16-byte nonce, even ones none (EOF at once); records any byte
# it is sent, which would be a user's data.
RACER = r"""
import glob, json, os, socket, sys, time
directory, wanted, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + seconds
attempts, stolen = 0, b""
while attempts < wanted and time.monotonic() < deadline:
    paths = glob.glob(os.path.join(directory, "v.sock_*"))
    if not paths:
        time.sleep(0.001)
    for path in paths:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        try:
            s.connect(path)
        except OSError:
            s.close()
            continue
        attempts += 1
        try:
            if attempts % 2:
                s.sendall(os.urandom(16))
            else:
                s.shutdown(socket.SHUT_WR)
            while data := s.recv(65536):
                stolen += data
        except OSError:
            pass
        finally:
            s.close()
print(json.dumps({"attempts": attempts, "stolen": stolen.hex()}), flush=True)
"""


async def echo_once(session: PortForwardSession, payload: bytes) -> tuple[bytes, str]:
    async with asyncio.timeout(ECHO_TIMEOUT_SECONDS):
        forwarded = await session.open(ECHO_PORT)
        await forwarded.data.send(payload)
        await forwarded.data.send_eof()
        return await read_all(forwarded.data), await forwarded.error()


async def test_a_guest_process_racing_the_dial_back_port_gets_nothing(
    cri: pb_grpc.RuntimeServiceStub, pods: Pods, sandbox_runtime: RuntimeDaemon
) -> None:
    pod = await run_pod(pods, "sb-race")
    await pods.server(pod, "echo", "echo", "127.0.0.1", ECHO_PORT)
    session = await port_forward(cri, pod, [ECHO_PORT])
    try:
        # One connection held open through the whole race (handed over: the shim no longer
        # holds it, and the pool's listener lives only while a call waits for its dial-back).
        held = await session.open(ECHO_PORT)
        await held.data.send(b"held")
        assert await held.data.receive() == b"held"
        agent_pid = (await shim_stats(sandbox_runtime, pod)).agent_pid
        assert agent_pid
        argv = [
            "nsenter", f"--target={agent_pid}", "--net", "--uts", "--ipc", "--",
            sys.executable, "-c", RACER,
            str(run_dir(sandbox_runtime, pod)), str(RACE_ATTEMPTS), str(RACE_SECONDS),
        ]  # fmt: skip
        racer = await asyncio.create_subprocess_exec(
            *argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        sent = wrong = 0
        try:
            while racer.returncode is None:
                payload = os.urandom(64) + b"user %d" % sent
                got, error = await echo_once(session, payload)
                sent += 1
                if (got, error) != (payload, ""):
                    wrong += 1
                try:
                    await asyncio.wait_for(asyncio.shield(racer.wait()), 0.001)
                except TimeoutError:
                    pass
            out, err = await racer.communicate()
        finally:
            if racer.returncode is None:
                racer.kill()
                await racer.wait()
        await held.data.send_eof()
        assert await read_all(held.data) == b""
    finally:
        await session.aclose()
    result = json.loads(out)
    print(f"\nracer: {result['attempts']} attempts; users: {sent} connections")
    assert result["attempts"] >= RACE_ATTEMPTS, err
    assert result["stolen"] == "", "the racer received a user's bytes"
    assert sent > 0 and wrong == 0
    stats = await shim_stats(sandbox_runtime, pod)
    # Every racer connection the shim accepted was counted and closed; the others were still
    # queued when their listener closed (its last call was served), and the kernel reset them.
    assert 0 < stats.stray_dial_backs <= result["attempts"]
    assert stats.agent_port_forwards == sent + 1
