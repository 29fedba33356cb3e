"""What judging outside the program's sandbox costs: one code case of each test form, timed side by side.

    python benchmarks/code_reward_forms.py [--repeat 20]

The same task (``square(x)``, one case) as a stdin/stdout test (one sandbox; stdout compared in this process),
a call-based test (one sandbox; the answer decoded from plain data and compared here) and an assert test (two
sandboxes, the program's and the test's, with one call relayed: portrl/rewards/code_judge.py), each scored by
portrl.rewards.code.compute_score ``--repeat`` times in turn, one case at a time. Prints the median and the
spread in milliseconds and each form's ratio to the stdin/stdout form. Name the machine (``lscpu``) with the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from portrl.rewards.code import compute_score  # noqa: E402

FORMS = {
    "stdin/stdout": ("x = int(input())\nprint(x * x)\n", {"inputs": ["3\n"], "outputs": ["9\n"]}),
    "call-based": ("def square(x):\n    return x * x\n", {"fn_name": "square", "inputs": [[3]], "outputs": [9]}),
    "assert": ("def square(x):\n    return x * x\n", {"asserts": ["assert square(3) == 9"]}),
    "check()": ("def square(x):\n    return x * x\n",
                {"test": "def check(candidate):\n    assert candidate(3) == 9\n", "entry_point": "square"}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(args.repeat):
        for form, (program, tests) in FORMS.items():  # interleaved: a slow moment of the machine hits every form
            start = time.perf_counter()
            result = compute_score(f"```python\n{program}```", json.dumps(tests), max_workers=1)
            times[form].append(time.perf_counter() - start)
            if result["score"] != 1.0:
                raise SystemExit(f"{form}: the real solution scored {result}")
    base = statistics.median(times["stdin/stdout"])
    print(f"{'form':<14} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'ratio':>6}")
    for form, values in times.items():
        median = statistics.median(values)
        print(f"{form:<14} {median * 1e3:>10.1f} {min(values) * 1e3:>8.1f} {max(values) * 1e3:>8.1f} "
              f"{median / base:>6.2f}")


if __name__ == "__main__":
    main()
