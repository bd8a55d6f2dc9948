"""Emulated hosts that answer ssh: network namespaces (scripts/netns.py), each running its own
sshd (Debian's openssh-server) on its private address, with a fresh key pair for the client.
Used to try ``bpslaunch -H`` for real on one machine (tests/clusters/test_launcher_ssh.py); as root:

    .venv/bin/python scripts/netns_ssh.py --hosts 2 -- \\
        bpslaunch -np 4 -H {host0}:2,{host1}:2 {ssh} python examples/train_digits.py

runs the command inside the first host's namespace, with ``{hostN}`` replaced by the hosts'
addresses, ``{ssh}`` by the ssh options that reach them, and this interpreter's bin directory
first on PATH (``bpslaunch`` and ``python`` are the virtualenv's without activating it). The namespaces share this
machine's file system (as hosts share a checkout over NFS), so the same paths work on each.
Nothing listens outside the namespaces; everything is stopped and deleted at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import netns  # noqa: E402

SSHD = "/usr/sbin/sshd"  # sshd refuses to start unless run by its absolute path
START_SECONDS = 10.0


def check_prerequisites() -> None:
    """Raise NetnsError unless namespaces can be made and sshd and ssh are installed."""
    netns.check_prerequisites()
    for tool, where in ((SSHD, "openssh-server"), ("ssh", "openssh-client"), ("ssh-keygen", "openssh-client")):
        if shutil.which(tool) is None:
            raise netns.NetnsError(f"{tool} is not installed (apt-get install {where})")


class SshHosts:
    """``count`` hosts on one switch, each with an sshd that admits one fresh key.

    ``ssh_args`` are bpslaunch's options that reach them (identity file, no host key
    checks: the host keys are made for this run and die with it).
    """

    def __init__(self, count: int, mbit: float = 0, network: type[netns.Network] = netns.Network) -> None:
        self.names = [f"host{i}" for i in range(count)]
        self.net = network(self.names, mbit)  # netns.TwoLinkNetwork: a second link on each host
        self.dir = tempfile.mkdtemp(prefix="bpsg_netns_ssh_")
        self.key = os.path.join(self.dir, "id_ed25519")
        self.sshd: dict[str, subprocess.Popen] = {}

    @property
    def addresses(self) -> list[str]:
        """The hosts' addresses, in order."""
        return [self.net.address(name) for name in self.names]

    @property
    def ssh_args(self) -> list[str]:
        """bpslaunch's ssh options for these hosts."""
        return ["--ssh-identity-file", self.key, "--ssh-option", "StrictHostKeyChecking=no",
                "--ssh-option", "UserKnownHostsFile=/dev/null", "--ssh-option", "LogLevel=ERROR"]

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return self.net.exec_argv(host, argv)

    def pids(self, host: str) -> list[int]:
        """Every process inside ``host``'s namespace but its sshd."""
        found = netns.run(["ip", "netns", "pids", self.net.hosts[host].namespace], check=False).split()
        return [int(p) for p in found if int(p) != self.sshd[host].pid]

    def __enter__(self) -> SshHosts:
        try:
            self.net.create()
            keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
            subprocess.run([*keygen, "-f", self.key], check=True, timeout=30)
            subprocess.run([*keygen, "-f", os.path.join(self.dir, "host_key")], check=True, timeout=30)
            shutil.copy(self.key + ".pub", os.path.join(self.dir, "authorized_keys"))
            os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
            for name in self.names:
                self._start_sshd(name)
            for name in self.names:
                self._wait_listening(name)
        except BaseException:
            self.close()
            raise
        return self

    def set_link(self, name: str, up: bool) -> None:
        """Bring ``name``'s link down (a network partition: its processes run on, unheard) or up."""
        netns.run(["ip", "-n", self.net.hosts[name].namespace, "link", "set", self.net.interface,
                   "up" if up else "down"])

    def restart_sshd(self, name: str) -> None:
        """Start ``name``'s sshd again once it is gone (a test killed the host), and wait for it."""
        try:
            self.sshd[name].wait(5)
        except subprocess.TimeoutExpired:
            return  # still running
        self._start_sshd(name)
        self._wait_listening(name)

    def _start_sshd(self, name: str) -> None:
        config = os.path.join(self.dir, f"sshd_{name}.conf")
        with open(config, "w") as file:
            file.write(f"""ListenAddress {self.net.address(name)}
Port 22
HostKey {self.dir}/host_key
AuthorizedKeysFile {self.dir}/authorized_keys
PidFile {self.dir}/sshd_{name}.pid
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
""")
        log = os.path.join(self.dir, f"sshd_{name}.log")
        self.sshd[name] = subprocess.Popen(self.exec_argv(name, [SSHD, "-D", "-f", config, "-E", log]),
                                           stdin=subprocess.DEVNULL, start_new_session=True)

    def _wait_listening(self, name: str) -> None:
        deadline = time.monotonic() + START_SECONDS
        probe = ["ssh", "-i", self.key, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                 "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=2",
                 self.net.address(name), "true"]
        while True:
            if self.sshd[name].poll() is not None:
                raise netns.NetnsError(f"sshd on {name} exited: {self._log(name)}")
            if subprocess.run(self.exec_argv(self.names[0], probe), capture_output=True, timeout=30).returncode == 0:
                return
            if time.monotonic() > deadline:
                raise netns.NetnsError(f"sshd on {name} does not answer after {START_SECONDS:g} s: {self._log(name)}")
            time.sleep(0.2)

    def _log(self, name: str) -> str:
        try:
            return Path(self.dir, f"sshd_{name}.log").read_text()[-500:]
        except OSError:
            return "(no log)"

    def close(self) -> None:
        """Stop the sshds, delete the namespaces (and whatever still runs there), remove the keys."""
        for proc in self.sshd.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self.net.destroy()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()


def expand(command: Sequence[str], addresses: Sequence[str], ssh_args: Sequence[str]) -> list[str]:
    """``command`` with ``{hostN}`` replaced by host N's address and a ``{ssh}`` word by ``ssh_args``."""
    out: list[str] = []
    for word in command:
        if word == "{ssh}":
            out += ssh_args
            continue
        for index, address in enumerate(addresses):
            word = word.replace(f"{{host{index}}}", address)
        out.append(word)
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command line; ``command`` without a leading ``--``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    parser.add_argument("--mbit", type=float, default=0, help="every link's rate (0: unlimited)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="run in host0's namespace with this interpreter's bin directory first on PATH")
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        parser.error("no command")
    if args.hosts < 1:
        parser.error("--hosts must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command in the first host's namespace, with the hosts up."""
    args = parse_args(argv)
    check_prerequisites()
    netns.cleanup_leftovers()
    with SshHosts(args.hosts, args.mbit) as hosts:
        argv_out = expand(args.command, hosts.addresses, hosts.ssh_args)
        print("netns_ssh: hosts " + ", ".join(f"host{i}={a}" for i, a in enumerate(hosts.addresses)),
              file=sys.stderr, flush=True)
        # A bare `bpslaunch` or `python` is this interpreter's, also under sudo (which resets PATH);
        # bpslaunch forwards that PATH over ssh, so it is the same one on every host.
        return subprocess.run(hosts.exec_argv("host0", argv_out), env=netns.interpreter_env(os.environ)).returncode


if __name__ == "__main__":
    sys.exit(main())
