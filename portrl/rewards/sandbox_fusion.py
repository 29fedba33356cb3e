"""Run sandbox cases on a remote SandboxFusion service (``reward.code.sandbox_fusion_url``) instead of locally.

SandboxFusion's documented HTTP API (https://bytedance.github.io/SandboxFusion/docs/api/run-code-run-code-post):
``POST <url>/run_code`` with JSON ``{"code", "language": "python", "stdin", "compile_timeout", "run_timeout",
"files": {}, "fetch_files": []}``; the answer is ``{"status": "Success" | "Failed" | "SandboxError",
"message", "compile_result", "run_result"}`` where a result is ``{"status": "Finished" | "Error" |
"TimeLimitExceeded", "execution_time", "return_code", "stdout", "stderr"}``. The url may be the service's
root or its ``/run_code`` endpoint (verl's config holds the latter).

Each answer becomes a :class:`portrl.rewards.sandbox.RunResult` with the same statuses as a local run
(TimeLimitExceeded -> "timeout"; a failed run is classified from its exit code and stderr as locally; stdout
longer than ``output_bytes`` -> "output_limit"). A 504 or an unreachable service is retried 3 times (1 s,
2 s apart); after that, or on a "SandboxError" answer or an unreadable one, :class:`SandboxError` is raised
naming the url: a service that does not work is not the program's fault, so it stops the scoring instead
of scoring 0 (verl scores such a case as failed).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from portrl.rewards.sandbox import RunResult, SandboxError, SandboxLimits, classify_exit

RETRIES = 3
RETRY_DELAY_S = 1.0  # before retry n (1-based): n x this


def run_code_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/run_code") else url + "/run_code"


def call_run_code(url: str, source: str, stdin: str, limits: SandboxLimits) -> RunResult:
    """One case on the service at ``url`` (module docstring)."""
    endpoint = run_code_url(url)
    payload = json.dumps({"code": source, "language": "python", "stdin": stdin,
                          "compile_timeout": limits.timeout_s, "run_timeout": limits.timeout_s,
                          "files": {}, "fetch_files": []}).encode()
    request = urllib.request.Request(endpoint, data=payload, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
    last = ""
    for attempt in range(RETRIES):
        try:
            with urllib.request.urlopen(request, timeout=2 * limits.timeout_s + 10) as response:
                answer = json.loads(response.read().decode("utf-8", "replace"))
            break
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
            if exc.code != 504:
                raise SandboxError(f"SandboxFusion at {endpoint} answered {last}") from None
        except (urllib.error.URLError, OSError) as exc:
            last = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
        except json.JSONDecodeError as exc:
            raise SandboxError(f"SandboxFusion at {endpoint} answered something that is not JSON ({exc.msg})") from None
        if attempt < RETRIES - 1:
            time.sleep((attempt + 1) * RETRY_DELAY_S)
    else:
        raise SandboxError(f"SandboxFusion at {endpoint} failed {RETRIES} times (last: {last}); check "
                           "reward.code.sandbox_fusion_url, or set it to null to run programs locally")
    return _to_result(answer, limits, endpoint)


def _to_result(answer: dict, limits: SandboxLimits, endpoint: str) -> RunResult:
    if not isinstance(answer, dict) or answer.get("status") not in ("Success", "Failed", "SandboxError"):
        raise SandboxError(f"SandboxFusion at {endpoint} answered an unknown shape: {str(answer)[:200]}")
    if answer["status"] == "SandboxError":
        raise SandboxError(f"SandboxFusion at {endpoint} reported SandboxError: {answer.get('message')}")
    run = answer.get("run_result") or {}
    compiled = answer.get("compile_result") or {}
    stdout = run.get("stdout") or ""
    stderr = (run.get("stderr") or compiled.get("stderr") or "")[-limits.stderr_bytes:]
    returncode = run.get("return_code")
    elapsed = float(run.get("execution_time") or 0.0)
    if compiled.get("status") in ("Error", "TimeLimitExceeded") or (compiled.get("return_code") or 0) != 0:
        status = "syntax_error"
    elif run.get("status") == "TimeLimitExceeded":
        status = "timeout"
    elif len(stdout.encode()) > limits.output_bytes:
        status = "output_limit"
    elif answer["status"] == "Success" and run.get("status") == "Finished" and not returncode:
        status = "ok"
    else:
        status = classify_exit(returncode if returncode is not None else 1, stderr, False, False, elapsed,
                           int(limits.timeout_s) + 1)
        status = "runtime_error" if status == "ok" else status
    return RunResult(status, stdout[:limits.output_bytes], stderr, elapsed, returncode, 0,
                     details={"sandbox_fusion": endpoint})

