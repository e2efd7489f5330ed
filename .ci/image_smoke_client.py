"""Requests through a router started from the image (by .ci/build-image.sh), as a client would send them.

Waits for the router's GET /ready, then sends chat completions through the openai client, plain and streamed,
all sharing one long system prompt. Passes when every answer has content and usage, /v1/models lists the
model, and the router's /metrics shows that the KV events of the simulated replicas reached its prefix index:
tokens it predicted cached on the chosen replica, and tokens the replica reported cached. A later request
is sent only after the previous one finished, so its shared prefix can be known by then. Exit 0 or 1; every
wait is bounded.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request

from openai import OpenAI

SYSTEM = "You are the support assistant of a logistics company. " + " ".join(
    f"Rule {i}: answer shipment question {i} politely and with the tracking number." for i in range(40)
)


def wait_ready(base: str, deadline_s: float) -> None:
    """Until GET /ready answers 200 (fleet loaded, replicas probed), or raise after `deadline_s`."""
    stop = time.monotonic() + deadline_s
    last = "no answer"
    while time.monotonic() < stop:
        try:
            with urllib.request.urlopen(f"{base}/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except urllib.error.HTTPError as error:
            last = f"{error.code} {error.read()[:200]!r}"
        except OSError as error:
            last = str(error)
        time.sleep(0.3)
    raise RuntimeError(f"router not ready after {deadline_s:.0f} s: {last}")


def counter(base: str, name: str) -> float:
    """The sum of a counter's samples over every label set in the router's /metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("router", help="the router's base URL, http://127.0.0.1:PORT")
    parser.add_argument("--model", required=True)
    parser.add_argument("--requests", type=int, default=6)
    args = parser.parse_args()
    base = args.router.rstrip("/")
    try:
        wait_ready(base, 60)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=30, max_retries=0)
        models = [model.id for model in client.models.list()]
        if args.model not in models:
            raise RuntimeError(f"/v1/models lists {models}, not {args.model}")
        for i in range(args.requests):
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Where is parcel {i}?"}]
            if i % 2:
                chunks = client.chat.completions.create(
                    model=args.model,
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=8,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                parts = [chunk for chunk in chunks]
                text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
                usage = parts[-1].usage if parts else None
            else:
                reply = client.chat.completions.create(model=args.model, messages=messages, max_tokens=8)  # type: ignore[arg-type]
                text = reply.choices[0].message.content or ""
                usage = reply.usage
            if not text or usage is None or usage.completion_tokens < 1:
                raise RuntimeError(f"request {i}: empty answer or no usage ({text!r}, {usage})")
            time.sleep(0.3)  # the replica publishes the blocks it stored; give the router's index a moment
        predicted = counter(base, "kvrouter_predicted_cached_tokens_total")
        actual = counter(base, "kvrouter_actual_cached_tokens_total")
        if predicted <= 0 or actual <= 0:
            raise RuntimeError(f"no prefix reuse seen: predicted {predicted:.0f}, reported {actual:.0f} cached tokens")
    except Exception as error:  # the report is the point: name what failed, exit 1
        print(f"image smoke: FAILED: {error}", file=sys.stderr)
        return 1
    print(
        f"image smoke: {args.requests} requests answered; cached tokens predicted {predicted:.0f}, "
        f"reported by the replicas {actual:.0f}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
