"""A booted board's `kiln serve`, from the host, through QEMU's forwarded port, with the official
openai client. `xtask`'s boot stages run it; what it checks against comes from the host.

argv: MODE BASE_URL OUT_REPORT EXPECT_JSON
  MODE pass: /health turns 200 with the PASS verdict; models.list names the model; a completion
             and a chat completion, each plain and streamed, give the tokens and text that kiln
             computed on the host for the same prompt and chat template (EXPECT_JSON: model_id,
             completion {prompt, max_tokens, tokens, text}, chat {messages, max_tokens, tokens,
             text}).
  MODE fail: /health is 503 `selfcheck_failed` naming every failed check (EXPECT_JSON: failed),
             the /v1 endpoints answer 503 naming them too, in OpenAI's error shape.
Both write the bytes of GET /kiln/report to OUT_REPORT (the caller compares them with the card's).
Exits non-zero with a message on the first failure.
"""
import http.client
import json
import sys
import time
import urllib.parse

import openai

mode, base, out_report, expect_path = sys.argv[1:5]
expect = json.load(open(expect_path))
u = urllib.parse.urlsplit(base)
HOST, PORT = u.hostname, u.port
WAIT = 900  # s: the board loads the model under TCG after its self-check


def raw(method, path, body=None, timeout=300):
    c = http.client.HTTPConnection(HOST, PORT, timeout=timeout)
    c.request(method, path, body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)
    print("ok:", what, flush=True)


# /health answers once the board's kiln serve listens (QEMU accepts the forwarded connection
# before that and drops it: retry).
started, health = time.monotonic(), None
while time.monotonic() - started < WAIT:
    try:
        st, body = raw("GET", "/health", timeout=10)
        health = (st, json.loads(body))
        if mode == "fail" or st == 200 or health[1].get("status") not in ("loading",):
            break
    except (OSError, http.client.HTTPException, ValueError):
        pass
    time.sleep(1)
check(health is not None, f"/health answered within {WAIT} s")
print(f"/health after {time.monotonic() - started:.1f} s: {health[0]} {json.dumps(health[1])}", flush=True)

st, report = raw("GET", "/kiln/report")
check(st == 200 and json.loads(report)["verdict"] == ("PASS" if mode == "pass" else "FAIL"),
      "/kiln/report is the boot's report")
with open(out_report, "wb") as f:
    f.write(report)

client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)

if mode == "pass":
    check(health[0] == 200 and health[1]["status"] == "ok" and health[1]["verdict"] == "PASS",
          "/health is 200 with the PASS verdict")
    mid = expect["model_id"]
    check([m.id for m in client.models.list().data] == [mid], f"models.list names {mid}")

    c = expect["completion"]
    r = client.completions.create(model=mid, prompt=c["prompt"], max_tokens=c["max_tokens"], temperature=0)
    print(f"board completion: {r.choices[0].text!r}", flush=True)
    check(r.model_extra["kiln"]["tokens"] == c["tokens"] and r.choices[0].text == c["text"],
          f"the completion is the host's greedy {len(c['tokens'])} tokens")
    check(r.usage.completion_tokens == len(c["tokens"]), "completion usage counts")
    s = client.completions.create(model=mid, prompt=c["prompt"], max_tokens=c["max_tokens"], temperature=0,
                                  stream=True)
    check("".join(ch.choices[0].text for ch in s) == c["text"], "the streamed completion is the same text")

    h = expect["chat"]
    msgs = [{"role": r_, "content": t} for r_, t in h["messages"]]
    r = client.chat.completions.create(model=mid, messages=msgs, max_tokens=h["max_tokens"], temperature=0)
    print(f"board chat: {r.choices[0].message.content!r}", flush=True)
    check(r.model_extra["kiln"]["tokens"] == h["tokens"] and r.choices[0].message.content == h["text"],
          f"the chat completion is the host's greedy reply through the same template ({len(h['tokens'])} tokens)")
    s = client.chat.completions.create(model=mid, messages=msgs, max_tokens=h["max_tokens"], temperature=0,
                                       stream=True)
    check("".join(ch.choices[0].delta.content or "" for ch in s if ch.choices) == h["text"],
          "the streamed chat is the same text")
else:
    failed = expect["failed"]
    check(len(failed) > 0, f"the console's report names failed checks ({', '.join(failed)})")
    check(health[0] == 503 and health[1]["status"] == "selfcheck_failed"
          and all(f in health[1]["error"] for f in failed) and health[1]["verdict"] == "FAIL",
          f"/health is 503 selfcheck_failed naming {', '.join(failed)}")
    mid = client.models.list().data[0].id
    for what, call in [
        ("completions", lambda: client.completions.create(model=mid, prompt="x", max_tokens=4)),
        ("chat", lambda: client.chat.completions.create(model=mid, max_tokens=4,
                                                        messages=[{"role": "user", "content": "x"}])),
    ]:
        try:
            call()
            check(False, f"{what}: answered after a FAIL")
        except openai.APIStatusError as e:
            body = e.body if isinstance(e.body, dict) else {}
            check(e.status_code == 503 and body.get("code") == "selfcheck_failed"
                  and all(f in body.get("message", "") for f in failed),
                  f"{what}: 503 selfcheck_failed naming the failed checks")
print("serve_board: all checks passed", flush=True)
