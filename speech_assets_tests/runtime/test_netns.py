"""A private network namespace (speech_assets/runtime/netns.py), attacked by another local user:
a server inside it is reachable from inside only, and the namespace cannot be entered by anyone
but its owner, whether the owner is root or an unprivileged user (then a user namespace holds it).
Real processes switched with setpriv; skipped where this is not root."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from speech_assets_tests.support import other_user

PORT = 8799
# the owner: a private network with a server inside; prints where it is, then waits for stdin
OWNER = textwrap.dedent(
    f"""
    import json, socket, subprocess, sys
    from speech_assets.runtime.netns import PrivateNetwork
    from speech_assets.runtime.waiting import wait_until

    server = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', {PORT})); s.listen(); "
              "s.accept()[0].send(b'hi'); s.accept()")
    with PrivateNetwork() as network:
        process = subprocess.Popen(network.enter([sys.executable, "-c", server]))
        wait_until(lambda: network.listening({PORT}), 30, "the server")
        inside = subprocess.run(network.enter([sys.executable, "-c",
                                "import socket; print(socket.create_connection(('127.0.0.1', {PORT}))"
                                ".recv(2).decode())"]),
                                capture_output=True, text=True, timeout=60)
        try:
            socket.create_connection(("127.0.0.1", {PORT}), timeout=5)
            outside = "connected"
        except OSError as error:
            outside = type(error).__name__
        print(json.dumps({{"pid": network.pid, "user_namespace": network.user_namespace,
                           "inside": inside.stdout.strip() or inside.stderr[-2000:], "outside": outside}}), flush=True)
        sys.stdin.read()
        process.kill()
    """
)
# the other user: everything it may try to reach the server
ATTACKER = textwrap.dedent(
    """
    import json, socket, subprocess, sys
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    found = {}
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5)
        found["connect"] = "connected"
    except OSError as error:
        found["connect"] = type(error).__name__
    for flags in (["--net"], ["--user", "--net"], ["--user", "--preserve-credentials", "--net"]):
        probe = "import socket; socket.create_connection(('127.0.0.1', %d), timeout=5); print('connected')" % port
        done = subprocess.run(["nsenter", f"--target={pid}", *flags, "--", sys.executable, "-c", probe],
                              capture_output=True, text=True, timeout=60)
        found[" ".join(["nsenter", *flags])] = done.stdout.strip() or done.stderr.strip().splitlines()[-1]
    print(json.dumps(found))
    """
)


@pytest.fixture(scope="module")
def attacker() -> tuple[list[str], dict[str, str]]:
    if why := other_user.why_not():
        pytest.skip(f"needs another local user: {why}")
    python = other_user.python_for(other_user.NOBODY)
    if python is None:
        pytest.skip("no Python interpreter the user nobody may run")
    return python


@pytest.mark.parametrize("owner", ["root", "unprivileged user"])
def test_another_local_user_cannot_reach_or_enter_a_private_network(
    owner: str, attacker: tuple[list[str], dict[str, str]]
) -> None:
    if owner == "root":
        python: tuple[list[str], dict[str, str]] | None = other_user.python_for(0, packages=True)
        command = [*python[0], "-c", OWNER] if python else []
    else:
        uid = other_user.spare_uid()
        python = other_user.python_for(uid, packages=True)
        command = other_user.as_user(uid, [*python[0], "-c", OWNER]) if python else []
    if python is None:
        pytest.skip(f"no Python interpreter with psutil that the {owner} may run")
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=python[1], cwd="/"
    )
    try:
        assert process.stdout is not None
        where = json.loads(process.stdout.readline())
        assert where["user_namespace"] == (owner != "root")
        assert where["inside"] == "hi", where  # the owner's own processes reach it
        assert where["outside"] == "ConnectionRefusedError"  # the host's loopback is another one
        with other_user.shared_folder() as shared:
            (shared / "attack.py").write_text(ATTACKER)
            (shared / "attack.py").chmod(0o644)
            command = [*attacker[0], str(shared / "attack.py"), str(where["pid"]), str(PORT)]
            done = subprocess.run(
                other_user.as_user(other_user.NOBODY, command),
                env=attacker[1],
                capture_output=True,
                text=True,
                timeout=120,
                cwd="/",
            )
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        assert found.pop("connect") == "ConnectionRefusedError"
        assert all(
            "connected" not in outcome and "Permission denied" in outcome or "not permitted" in outcome
            for outcome in found.values()
        ), found
    finally:
        process.communicate(timeout=60)
    assert process.returncode == 0
