"""LAVA jobs against lava-common's own job schema and against a real boot's console.

argv: CONSOLE WANT JOB.yaml...  (WANT: id=pass|fail|skip,... the report's checks in order).
PYTHONPATH holds lava-common's package (lava_common), unpacked from Debian's .deb.
Exits non-zero with a message on the first failure.
"""
import copy
import re
import sys

import yaml
from lava_common.schemas import validate
from voluptuous import Invalid

console_path, want_s, jobs = sys.argv[1], sys.argv[2], sys.argv[3:]
want = [tuple(x.split("=", 1)) for x in want_s.split(",") if x]
console = open(console_path, encoding="utf-8", errors="replace").read().replace("\r", "")


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)
    print("ok:", what)


def rejected(job, what):
    try:
        validate(job, strict=True)
    except Invalid as e:
        check(True, f"{what} is rejected by the schema ({e})")
        return
    check(False, f"{what} is rejected by the schema (it validated)")


def monitors(job):
    return [m for a in job["actions"] for m in (a.get("test") or {}).get("monitors", [])]


for path in jobs:
    job = yaml.safe_load(open(path, encoding="utf-8"))
    validate(job, strict=True)
    check(True, f"{path} validates against lava-common's job schema")
    broken = copy.deepcopy(job)
    del broken["device_type"]
    rejected(broken, f"{path} without device_type")
    broken = copy.deepcopy(job)
    del monitors(broken)[0]["pattern"]
    rejected(broken, f"{path} with a monitor without its pattern")

    # As LAVA's monitor does: wait for `start`, then take every `pattern` match until `end`.
    cases = []
    for m in monitors(job):
        s = re.search(m["start"], console)
        check(s is not None, f"{path}: monitor {m['name']}'s start {m['start']!r} is on the console")
        e = re.search(m["end"], console[s.end():])
        check(e is not None, f"{path}: monitor {m['name']}'s end {m['end']!r} follows it")
        seg = console[s.end(): s.end() + e.start()]
        groups = re.compile(m["pattern"]).groupindex
        check("test_case_id" in groups and "result" in groups,
              f"{path}: monitor {m['name']}'s pattern names test_case_id and result")
        for g in re.finditer(m["pattern"], seg):
            d = g.groupdict()
            cases.append((d["test_case_id"], m.get("fixupdict", {}).get(d["result"], d["result"])))
    check(cases == want, f"{path}: the monitors find the report's {len(want)} checks as test cases, "
          f"in order, with their results (found {len(cases)}: {cases[:3]}…)")
print("lava_jobs: all checks passed")
