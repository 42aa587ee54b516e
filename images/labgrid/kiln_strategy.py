"""kiln's labgrid strategy: a board goes off -> written -> verdict -> shell -> serving.

One strategy for both environments in this folder:

- ``qemu-virt.yaml``: ``QEMUDriver`` is power and console; "written" copies the image to the
  file the driver's ``disk`` names (a copy: the board's writes stay there, the built image is
  untouched); the board's HTTP port is forwarded to a free port on 127.0.0.1.
- ``qemu-virt-remote.yaml``: the QEMU board as a remote place (``cargo xtask labgrid
  --remote``): the console is the place's serial port (ser2net), power an external command that
  starts and kills QEMU, "written" a copy to the file the strategy's ``disk`` names, HTTP the
  place's ``NetworkService`` at ``http_port``.
- ``rock-5b.yaml``: a serial console, a power switch, an SD mux; "written" switches the card
  to the host, writes the image with ``bmaptool`` (the ``.bmap`` beside it), and gives the card
  back to the board; HTTP goes to the board's address (a ``NetworkService``).

"verdict" powers the board on and waits for the self-check's verdict line
(``KILN-SELFTEST: PASS|FAIL n/m manifest=<sha256>``); the console text of that boot is kept,
so a test reads its ``KILN-CHECK <id> PASS|FAIL|SKIP <ms>`` lines. "shell" is the console shell
init starts after the verdict; "serving" is ``kiln serve`` answering ``/health`` (200 with a
model; 503 naming why when the card holds none, which still serves the report).

"off" is a power cut wherever it is called: QEMU's ``quit`` over QMP (the guest syncs nothing),
the rack's power switch. ``await_verdict()`` waits for the next boot's verdict after a reboot the
board did itself (``reboot`` on the shell, a failed slot). From "off" the board boots what is on
its card; only "written" (or the first transition) writes the image.
"""

import enum
import json
import math
import os
import re
import shutil
import socket
import time
import urllib.error
import urllib.request

import attr
from labgrid.factory import target_factory
from labgrid.step import step
from labgrid.strategy import Strategy, StrategyError, never_retry

VERDICT = re.compile(rb"KILN-SELFTEST: (PASS|FAIL) (\d+)/(\d+) manifest=([0-9a-f]{64})")
CHECK_LINE = re.compile(r"^KILN-CHECK (\S+) (PASS|FAIL|SKIP) (\d+)$")


class Status(enum.Enum):
    unknown = 0
    off = 1
    written = 2
    verdict = 3
    shell = 4
    serving = 5


def check_lines(console_text):
    """The ``KILN-CHECK`` lines of one boot's console as ``[(id, status, ms)]``, in order. A line
    a kernel message broke is not a check line (its check is then missing, which the caller sees
    when it compares with the report)."""
    out = []
    for line in console_text.splitlines():
        m = CHECK_LINE.match(line.rstrip("\r"))
        if m:
            out.append((m.group(1), m.group(2), int(m.group(3))))
    return out


def report_lines(report):
    """What the check lines of ``report`` (kiln's report.json, parsed) must be: the id, the
    status in capitals, the duration rounded half away from zero (Rust's ``f64::round``)."""
    return [
        (c["id"].replace(" ", "_"), c["status"].upper(), math.floor(c["duration_ms"] + 0.5))
        for c in report["checks"]
    ]


@target_factory.reg_driver
@attr.s(eq=False)
class KilnStrategy(Strategy):
    """Puts a kiln board into a state; see the module's text."""

    bindings = {
        "power": "PowerProtocol",
        "console": "ConsoleProtocol",
        "shell": "ShellDriver",
        "sdmux": {"USBSDMuxDriver", "USBSDWireDriver", None},
        "storage": {"USBStorageDriver", None},
        "service": {"NetworkService", None},
    }

    # The images key of the kiln image to write (``cargo xtask image``'s output).
    image = attr.ib(default="kiln", validator=attr.validators.instance_of(str))
    # Seconds from power-on to the verdict line (TCG with a model's known answers takes minutes).
    boot_timeout = attr.ib(default=600.0, converter=float)
    # The port of the recipe's [serve].
    http_port = attr.ib(default=8080, converter=int)
    # Where the board reaches the test host (a bundle served from there): QEMU's user network
    # gateway unless the environment says otherwise.
    host_address = attr.ib(default="10.0.2.2", validator=attr.validators.instance_of(str))
    # The images key of the file a QEMU board boots when its power driver does not name it
    # (a remote place: QEMU started by an external power command, ``qemu-virt-remote.yaml``).
    disk = attr.ib(default=None, validator=attr.validators.optional(attr.validators.instance_of(str)))

    status = attr.ib(default=Status.unknown)

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        self.boot_log = ""
        self.verdict = None
        self.manifest = None
        self.base_url = None
        self.health = None
        self._forwarded = None

    # -- what a test reads ---------------------------------------------------------------

    def checks(self):
        """The ``KILN-CHECK`` lines of the last boot, ``[(id, status, ms)]``."""
        return check_lines(self.boot_log)

    def image_path(self):
        return self.target.env.config.get_image_path(self.image)

    # -- transitions ---------------------------------------------------------------------

    @never_retry
    @step(args=["status"])
    def transition(self, status, *, step):  # pylint: disable=redefined-outer-name
        if not isinstance(status, Status):
            status = Status[status]
        if status == Status.unknown:
            raise StrategyError(f"can not transition to {status}")
        if status == self.status:
            step.skip("nothing to do")
            return
        if status == Status.off:
            self._power_off()
        elif status == Status.written:
            self._power_off()
            self._write()
        elif status == Status.verdict:
            if self.status == Status.unknown:
                self.transition(Status.written)
            if self.status in (Status.off, Status.written):
                self.target.activate(self.console)
                self.power.on()
                self._await_verdict()
            # shell/serving are after the verdict of the same boot: nothing to do.
        elif status == Status.shell:
            self.transition(Status.verdict)
            self.target.activate(self.shell)
        elif status == Status.serving:
            self.transition(Status.shell)
            self._await_http()
        else:
            raise StrategyError(f"no transition found from {self.status} to {status}")
        self.status = status

    @never_retry
    def await_verdict(self):
        """After a reboot the board did itself (or was told to on its shell): the next boot's
        verdict. The shell driver is deactivated first: its prompt is gone with the reboot."""
        self.target.deactivate(self.shell)
        self.base_url = None
        self._await_verdict()
        self.status = Status.verdict

    def reboot(self):
        """``reboot`` typed on the console shell, then the next boot's verdict."""
        self.transition(Status.shell)
        self.target.deactivate(self.shell)
        self.console.sendline("reboot")
        self.await_verdict()

    # -- the parts -----------------------------------------------------------------------

    def _power_off(self):
        self.target.deactivate(self.shell)
        self.target.activate(self.power)
        self.power.off()
        # The host port forwarded to the board (QEMU) stays: QEMUDriver re-adds its forwards at
        # every power-on, so the next boot is reached on the same port.
        self.base_url = None

    def _write(self):
        image = self.image_path()
        if not os.path.isfile(image):
            raise StrategyError(f"the kiln image {image} does not exist (cargo xtask image)")
        if self.storage is None:
            # QEMU: the board boots the file QEMUDriver's `disk` (or the strategy's) names;
            # write a copy of the image there.
            disk_key = getattr(self.power, "disk", None) or self.disk
            if disk_key is None:
                raise StrategyError(
                    "no USBStorageDriver to write the card with, and no `disk` (QEMUDriver's or "
                    "the strategy's) to write a QEMU board's file"
                )
            disk = self.target.env.config.get_image_path(disk_key)
            if os.path.realpath(disk) == os.path.realpath(image):
                raise StrategyError(
                    f"the QEMU disk {disk} is the image itself: name a copy's path, the board "
                    "writes to its disk"
                )
            tmp = disk + ".tmp"
            shutil.copyfile(image, tmp)
            os.replace(tmp, disk)
            return
        if self.sdmux is None:
            raise StrategyError("a USBStorageDriver without an SD mux driver to switch the card")
        from labgrid.driver.usbstoragedriver import Mode

        self.target.activate(self.sdmux)
        self.sdmux.set_mode("host")
        self.target.activate(self.storage)
        # bmaptool finds <image>.bmap beside the image and writes the mapped blocks only.
        self.storage.write_image(image, mode=Mode.BMAPTOOL)
        self.target.deactivate(self.storage)
        self.sdmux.set_mode("dut")

    def _await_verdict(self):
        self.verdict = None
        try:
            _, before, match, _ = self.console.expect(VERDICT, timeout=self.boot_timeout)
        except Exception as e:  # pexpect's TIMEOUT/EOF: say what was awaited
            raise StrategyError(
                f"no KILN-SELFTEST verdict on the console within {self.boot_timeout:.0f} s: {e}"
            ) from e
        text = before.decode("utf-8", "replace") if isinstance(before, bytes) else str(before)
        whole = match.group(0).decode()
        self.boot_log = text + whole
        self.verdict = match.group(1).decode()
        self.manifest = match.group(4).decode()

    def _await_http(self):
        if self.base_url is None:
            if self.service is not None:
                self.base_url = f"http://{self.service.address}:{self.http_port}"
            elif hasattr(self.power, "add_port_forward"):
                if self._forwarded is None:
                    port = _free_port()
                    self.power.add_port_forward("tcp", "127.0.0.1", port, "", self.http_port)
                    self._forwarded = port
                self.base_url = f"http://127.0.0.1:{self._forwarded}"
            else:
                raise StrategyError(
                    "no way to reach the board's HTTP port: give the place a NetworkService"
                )
        # Up is answering /health with kiln's JSON: 200 when a model is served, 503 with its
        # reason when none is (a board whose models partition holds none serves the report).
        deadline = time.monotonic() + 120
        last = None
        while time.monotonic() < deadline:
            try:
                try:
                    with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                        code, body = r.status, r.read()
                except urllib.error.HTTPError as e:
                    code, body = e.code, e.read()
                health = json.loads(body)
                if isinstance(health, dict) and "status" in health and health["status"] != "loading":
                    self.health = (code, health)
                    return
                last = f"HTTP {code} {health}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                last = e
            time.sleep(1)
        raise StrategyError(f"kiln serve did not answer {self.base_url}/health: {last}")


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
