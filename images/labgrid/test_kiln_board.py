"""kiln's board suite for labgrid: the same tests on the QEMU board and on a Rock 5B rack.

    pytest --lg-env images/labgrid/<env>.yaml images/labgrid/test_kiln_board.py

In order (module scope, each test builds on the board state the one before left):

1. the image is written and the board powered on; the self-check's verdict is PASS and every
   ``KILN-CHECK`` line on the console is the report's check (id, status, milliseconds);
2. the report read on the shell (its sha256 on the card) is the bytes ``kiln serve`` gives at
   ``/kiln/report``, and ``/health`` answers;
3. an A/B update: the bundle (``LG_KILN_BUNDLE``, made by ``cargo xtask bundle``) is served from
   the test host, fetched by the board, installed by RAUC into the other slot; after ``reboot``
   that slot boots, passes and is marked good;
4. a power cut (QEMU: ``quit`` over QMP; a rack: its power switch) right at the verdict of the
   next boot, when init writes the report and the slot state; powered on again, the board boots
   the same slot to a PASS.

Without ``LG_KILN_BUNDLE`` the update test is skipped, by name.
"""

import functools
import hashlib
import http.server
import json
import os
import threading
import urllib.request

import pytest

from kiln_strategy import report_lines


@pytest.fixture(scope="module")
def kiln(strategy):
    return strategy


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200, f"GET {url}: HTTP {r.status}"
        return r.read()


def _shell(target):
    return target.get_driver("ShellDriver")


def _report_on_card(target):
    """sha256 and size of /boot/kiln/report.json, read on the board's shell."""
    out = _shell(target).run_check("sha256sum /boot/kiln/report.json; stat -c %s /boot/kiln/report.json")
    sha = out[0].split()[0]
    return sha, int(out[1].strip())


def _lines_equal_report(kiln, report):
    got = kiln.checks()
    want = report_lines(report)
    assert got == want, (
        "the console's KILN-CHECK lines are not the report's checks:\n"
        f"  console only: {[c for c in got if c not in want]}\n"
        f"  report only:  {[c for c in want if c not in got]}"
    )


def test_boot_verdict_and_check_lines(kiln, target):
    kiln.transition("written")
    kiln.transition("serving")
    assert kiln.verdict == "PASS", f"self-check verdict {kiln.verdict}:\n{kiln.boot_log[-4000:]}"
    report = json.loads(_get(kiln.base_url + "/kiln/report"))
    assert report["verdict"] == "PASS"
    assert report["manifest"] == kiln.manifest, "the report's manifest is not the verdict line's"
    _lines_equal_report(kiln, report)
    assert len(kiln.checks()) == len(report["checks"]) > 0


def test_report_over_shell_and_http(kiln, target):
    kiln.transition("serving")
    served = _get(kiln.base_url + "/kiln/report")
    sha, size = _report_on_card(target)
    assert hashlib.sha256(served).hexdigest() == sha, (
        f"/kiln/report ({len(served)} bytes) is not the card's report.json ({size} bytes)"
    )
    assert len(served) == size
    code, health = kiln.health
    assert health.get("verdict") == "PASS", health
    # A model served: ready. None on the card (a fixture-only image): 503, saying so by name.
    assert (code, health.get("status")) == (200, "ok") or (
        code == 503 and health.get("status") == "error" and "no model" in health.get("error", "")
    ), (code, health)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def bundle_server():
    path = os.environ.get("LG_KILN_BUNDLE")
    if not path:
        pytest.skip("LG_KILN_BUNDLE is not set: no bundle to update with (cargo xtask bundle)")
    handler = functools.partial(_Quiet, directory=os.path.dirname(os.path.abspath(path)))
    srv = http.server.ThreadingHTTPServer(("0.0.0.0", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield os.path.basename(path), srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def _slot(report):
    return report.get("slot") or {}


def test_ab_update_boots_the_other_slot(kiln, target, bundle_server):
    name, port = bundle_server
    kiln.transition("serving")
    before = json.loads(_get(kiln.base_url + "/kiln/report"))
    booted = _slot(before).get("booted")
    assert booted in ("A", "B"), f"the report names no booted slot: {_slot(before)}"
    other = "B" if booted == "A" else "A"
    url = f"http://{kiln.host_address}:{port}/{name}"
    shell = _shell(target)
    shell.run_check(f"wget -q -O /tmp/update.raucb {url}", timeout=300)
    out = shell.run_check("rauc install /tmp/update.raucb 2>&1; rm -f /tmp/update.raucb", timeout=600)
    assert any("succeeded" in line for line in out), "rauc install did not succeed:\n" + "\n".join(out)
    kiln.reboot()
    assert kiln.verdict == "PASS", f"the updated slot's verdict {kiln.verdict}:\n{kiln.boot_log[-4000:]}"
    kiln.transition("serving")
    after = json.loads(_get(kiln.base_url + "/kiln/report"))
    _lines_equal_report(kiln, after)
    assert _slot(after).get("booted") == other, f"booted {_slot(after)} after installing into {other}"
    assert _slot(after).get("action") == "marked good", _slot(after)


def test_power_cut_at_the_verdict(kiln, target):
    kiln.transition("serving")
    booted = _slot(json.loads(_get(kiln.base_url + "/kiln/report"))).get("booted")
    # Cut while init writes the next boot's report and slot state: reboot, cut at its verdict.
    kiln.transition("shell")
    target.deactivate(_shell(target))
    kiln.console.sendline("reboot")
    kiln.await_verdict()
    kiln.transition("off")
    kiln.transition("serving")
    assert kiln.verdict == "PASS", f"verdict after the power cut {kiln.verdict}:\n{kiln.boot_log[-4000:]}"
    report = json.loads(_get(kiln.base_url + "/kiln/report"))
    _lines_equal_report(kiln, report)
    assert _slot(report).get("booted") == booted, f"booted {_slot(report)}, was {booted} before the cut"
    sha, _ = _report_on_card(target)
    assert hashlib.sha256(_get(kiln.base_url + "/kiln/report")).hexdigest() == sha
