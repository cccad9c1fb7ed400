"""The grammar mask budget over HTTP: an ambiguous grammar would make every decode step of its replica take seconds.

``start: x+ "☃"`` with ``x: "a" | "ab" | "abc" | "b" | "bc" | "c" | x x | x x x`` as ``structured_outputs.grammar``
on ``/v1/chat/completions``, greedy, ``max_tokens`` 1,024: its llguidance masks cost more at every token (a second
and more after some tens of tokens) and were computed on the engine's decode thread, so every row of the replica
waited (a probe client's latency 13.5x) until the client left. Now a row's mask work has a per-step budget
(``mask_step_budget_ms``, default 200 ms of CPU time); past it the row ends with ``finish_reason: "error"`` and an
``error`` naming the setting, and the other rows go on.

Four grammar requests at once (so that both model replicas of the shared app get some) while a probe client on
another address sends the seeded ``sentiment`` scenario one request after another, as ``bench/attack_rerun.py``
does. The probe's bound is generous (it proves "not seconds-long", not a speed): its slowest request during the
attack stays under 5 s or 6 times its slowest quiet request, whichever is more.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

AMBIGUOUS = 'start: x+ "\u2603"\nx: "a" | "ab" | "abc" | "b" | "bc" | "c" | x x | x x x'
PROBE = {"scenario": "sentiment", "prompt": "The food was great and the staff friendly.", "max_new_tokens": 8,
         "temperature": 0}
SETTING = "mask_step_budget_ms"


def _post(port: int, path: str, body: dict, source: str, timeout: float) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout, source_address=(source, 0))
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
        answer = conn.getresponse()
        data = answer.read()
        return answer.status, json.loads(data or b"{}"), time.perf_counter() - t0
    finally:
        conn.close()


def test_an_ambiguous_grammar_ends_with_an_error_and_does_not_hold_other_clients(serve_app):
    port = serve_app.port
    quiet = []
    for _ in range(3):
        status, body, took = _post(port, "/v1/generate", PROBE, "127.0.0.2", 120)
        assert status == 200, body
        quiet.append(took)
    samples: list[tuple[int, float]] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            status, _, took = _post(port, "/v1/generate", PROBE, "127.0.0.2", 600)
            samples.append((status, took))

    chat = {"model": "default", "messages": [{"role": "user", "content": "Write letters."}], "max_tokens": 1024,
            "temperature": 0, "structured_outputs": {"grammar": AMBIGUOUS}}
    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: _post(port, "/v1/chat/completions", chat, "127.0.0.3", 300), range(4)))
    finally:
        stop.set()
        prober.join(600)
    attack_s = time.perf_counter() - t0
    for status, body, _ in answers:
        assert status == 200, body
        choice = body["choices"][0]
        assert choice["finish_reason"] == "error", choice
        assert SETTING in choice["error"], choice["error"]
        assert body["usage"]["completion_tokens"] < 1024
    assert samples and all(status == 200 for status, _ in samples), samples
    slowest = max(took for _, took in samples)
    print(f"\ngrammar requests: {[round(t, 1) for _, _, t in answers]} s; probe: quiet max {max(quiet):.2f} s, during "
          f"the attack n={len(samples)} max {slowest:.2f} s ({slowest / max(quiet):.1f}x)")
    bound = max(5.0, 6 * max(quiet))
    assert slowest < bound, (f"a probe request took {slowest:.1f} s during the attack ({attack_s:.1f} s; quiet: "
                             f"{max(quiet):.2f} s)")
