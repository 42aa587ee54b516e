"""A rack's labgrid environment through labgrid's own loader (run by `cargo xtask test`, stage
boot-qemu-ab, with the pinned labgrid venv):

    python labgrid_envs.py images/labgrid/rock-5b.yaml

Every LG_* variable the file names gets a placeholder; the file must load (labgrid's Config and
Environment, the target built, every driver bound to its resource) and name each resource and
driver a kiln rack place needs. A broken copy (the SD mux left out) must not load: the storage
driver then has nothing to bind to.
"""

import os
import re
import subprocess
import sys
import tempfile

from labgrid import Environment

NEEDS_RESOURCES = {"RawSerialPort", "NetworkPowerPort", "USBSDMuxDevice", "NetworkService", "RKUSBLoader"}
NEEDS_DRIVERS = {"SerialDriver", "NetworkPowerDriver", "USBSDMuxDriver", "USBStorageDriver",
                 "RKUSBDriver", "ShellDriver", "KilnStrategy"}


def load(path):
    env = Environment(path)
    t = env.get_target("main")
    return ({type(r).__name__ for r in t.resources}, {type(d).__name__ for d in t.drivers}, t)


def strategy_helpers(path):
    """The strategy's parsers, which the suite's verdicts rest on: a line a kernel message broke
    is not a check line; durations round half away from zero, as the board's Rust does."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    from kiln_strategy import check_lines, report_lines

    got = check_lines("KILN-CHECK a PASS 1\r\nKILN-CHECK b PA[    1.234] SS 3\nxKILN-CHECK c FAIL 2\n"
                      "KILN-CHECK d SKIP 0\nKILN-CHECK e PASS 5[    2.5] virtio_net\n")
    assert got == [("a", "PASS", 1), ("d", "SKIP", 0)], got
    rep = {"checks": [{"id": "x y", "status": "fail", "duration_ms": 2.5},
                      {"id": "z", "status": "pass", "duration_ms": 1.4999}]}
    assert report_lines(rep) == [("x_y", "FAIL", 3), ("z", "PASS", 1)], report_lines(rep)
    print("labgrid_envs: kiln_strategy's check-line and report parsers hold")


def main(path):
    text = open(path).read()
    for var in sorted(set(re.findall(r"\$(LG_[A-Z0-9_]+)", text))):
        os.environ.setdefault(var, "3" if var.endswith("INDEX") else f"/placeholder/{var.lower()}")
    res, drv, t = load(path)
    assert NEEDS_RESOURCES <= res, f"{path}: resources missing: {NEEDS_RESOURCES - res}"
    assert NEEDS_DRIVERS <= drv, f"{path}: drivers missing: {NEEDS_DRIVERS - drv}"
    strategy = t.get_strategy()
    assert type(strategy).__name__ == "KilnStrategy", strategy
    assert strategy.storage is not None and strategy.sdmux is not None and strategy.service is not None, \
        "KilnStrategy did not bind the SD mux, the card's storage and the board's address"
    # A broken copy: without the SD mux the card's storage driver has nothing to bind to. Loaded
    # in another interpreter (labgrid registers the strategy once per process).
    broken = re.sub(r"\n      USBSDMuxDevice:\n        match:\n          ID_SERIAL_SHORT: [^\n]*", "", text)
    assert broken != text, "could not make the broken copy"
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=os.path.dirname(os.path.abspath(path))) as f:
        f.write(broken)
        f.flush()
        r = subprocess.run([sys.executable, __file__, "--load", f.name], capture_output=True, text=True)
        err = (r.stdout + r.stderr).strip().splitlines()
        assert r.returncode != 0, "the copy without the SD mux loaded"
        assert any("USBStorageDriver" in l or "USBSDMuxDriver" in l for l in err), err[-5:]
        print(f"labgrid_envs: the copy without the SD mux is refused: {err[-1]}")
    print(f"labgrid_envs: {path} loads in labgrid: resources {sorted(res)}, drivers {sorted(drv)}")


if __name__ == "__main__":
    if sys.argv[1] == "--load":
        load(sys.argv[2])
    elif sys.argv[1] == "--helpers":
        strategy_helpers(sys.argv[2])
    else:
        main(sys.argv[1])
        # In another interpreter: importing the strategy registers it with labgrid, once per process.
        subprocess.run([sys.executable, __file__, "--helpers", sys.argv[1]], check=True)
