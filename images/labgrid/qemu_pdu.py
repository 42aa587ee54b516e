"""The QEMU board's power switch for distributed labgrid: ``qemu_pdu.py STATE_DIR on|off``.

labgrid's ``ExternalPowerDriver`` (``qemu-virt-remote.yaml``) runs it where a rack's place has a
PDU outlet (``NetworkPowerDriver``): it is the stand-in for the PDU. ``on`` starts QEMU with the
command line in ``STATE_DIR/qemu.json`` (``cargo xtask labgrid --remote`` writes it: the boot
tests' machine, its serial on the loopback serial adapter's socket), in the process group that
file names (the farm's: whatever happens to the run, QEMU is killed with it), its output in the
log that file names, and returns; ``off`` kills it (SIGKILL: the guest syncs
nothing, a power cut) and waits until it is gone. Both are idempotent, as a PDU's are.
"""

import json
import os
import signal
import subprocess
import sys
import time


def _state(d):
    with open(os.path.join(d, "qemu.json"), encoding="utf-8") as f:
        return json.load(f)


def _running(d, argv):
    """The pid of the QEMU this script started, if it still runs (its command line, not only
    its pid: a pid can be reused; a killed QEMU no one reaped has an empty one)."""
    try:
        with open(os.path.join(d, "qemu.pid"), encoding="ascii") as f:
            pid = int(f.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().split(b"\0")[:-1]
    except (OSError, ValueError):
        return None
    if cmdline[1:] != [a.encode() for a in argv[1:]]:
        return None
    return pid


def on(d):
    st = _state(d)
    if _running(d, st["argv"]):
        return 0
    group = st.get("process_group")
    with open(st["log"], "ab") as log:
        p = subprocess.Popen(
            st["argv"], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=(lambda: os.setpgid(0, group)) if group else None,
            start_new_session=not group,
        )
    with open(os.path.join(d, "qemu.pid"), "w", encoding="ascii") as f:
        f.write(f"{p.pid}\n")
    try:
        code = p.wait(timeout=0.5)
    except subprocess.TimeoutExpired:
        return 0
    with open(st["log"], "rb") as f:
        tail = f.read()[-2000:].decode("utf-8", "replace")
    print(f"qemu_pdu: QEMU exited at once ({code}); {st['log']}:\n{tail}", file=sys.stderr)
    return 1


def off(d):
    st = _state(d)
    pid = _running(d, st["argv"])
    if pid:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _running(d, st["argv"]):
            if time.monotonic() > deadline:
                print(f"qemu_pdu: QEMU (pid {pid}) still runs 10 s after SIGKILL", file=sys.stderr)
                return 1
            time.sleep(0.05)
    try:
        os.remove(os.path.join(d, "qemu.pid"))
    except FileNotFoundError:
        pass
    return 0


def main(argv):
    if len(argv) != 3 or argv[2] not in ("on", "off"):
        print("usage: qemu_pdu.py STATE_DIR on|off", file=sys.stderr)
        return 2
    return on(argv[1]) if argv[2] == "on" else off(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
