"""Is the checkpoint directory one directory every process sees? Node-local disks that happen to
have the same path would each get their own checkpoints, and a restore would hang or diverge."""
from __future__ import annotations

import json
import os
import secrets
import time

from jaxtrain.resilience import exit_codes
from jaxtrain.resilience.coordination_keys import PREFIX
from jaxtrain.resilience.coordination_keys import one_line as _one_line


def check_shared_directory(peers, path: str) -> None:
    """Raises ValueError naming the hosts (hostname, process index) that do not see the
    directory `path` process 0 sees: process 0 writes a marker file holding a random nonce,
    the nonce goes through the coordinator, every process looks for the marker under its own
    `path` and the results are gathered; every process raises the same error. Call it
    before restoring, from every process. Creates `path` if missing."""
    if not peers.enabled:
        return
    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    peers._checks += 1
    key = f"shared/{peers._checks}"
    timeout_ms = int(peers.timeout_s * 1000)
    marker = None
    if peers.index == 0:
        nonce = secrets.token_hex(16)
        marker = os.path.join(path, f".jaxtrain-shared-{nonce}")
        with open(marker, "w") as f:
            f.write(nonce)
        peers._set(f"{key}/nonce", nonce)
    results, waiting_for = {}, 0
    try:
        nonce = peers.client.blocking_key_value_get(PREFIX + f"{key}/nonce", timeout_ms)
        seen = _sees_marker(os.path.join(path, f".jaxtrain-shared-{nonce}"), nonce, peers.timeout_s)
        peers._set(f"{key}/result/{peers.index}", json.dumps({"ok": seen, "host": peers.host, "path": path}))
        deadline = time.monotonic() + peers.timeout_s
        for waiting_for in range(peers.count):
            left_ms = max(int((deadline - time.monotonic()) * 1000), 1)
            results[waiting_for] = json.loads(
                peers.client.blocking_key_value_get(PREFIX + f"{key}/result/{waiting_for}", left_ms))
    except Exception as e:
        peers.abort(exit_codes.PEER, f"process {peers.index}: {peers.name(waiting_for)} did not answer the "
                                     f"shared-checkpoint-directory check within {peers.timeout_s:g} s "
                                     f"(not started, hung or dead?): {_one_line(e, 200)}")
    finally:
        if marker is not None:
            try:
                os.remove(marker)
            except OSError:
                pass
    missing = [j for j, r in sorted(results.items()) if not r["ok"]]
    if missing:
        others = ", ".join(f"process {j} (host {results[j]['host']}, {results[j]['path']})" for j in missing)
        raise ValueError(f"process {peers.index}: the checkpoint directory is not one directory shared by "
                         f"every process: {others} cannot see the marker that process 0 (host {results[0]['host']}) "
                         f"wrote in {results[0]['path']}; put the workdir on storage every host mounts")


def _sees_marker(marker: str, nonce: str, timeout_s: float) -> bool:
    """Looks for the marker for a few seconds: a network filesystem may show a new file on
    another host only after its attribute cache expires."""
    deadline = time.monotonic() + min(10.0, timeout_s / 3)
    while True:
        try:
            with open(marker) as f:
                if f.read() == nonce:
                    return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        try:
            os.listdir(os.path.dirname(marker))  # refreshes the directory's cached entries
        except OSError:
            pass
        time.sleep(0.2)
