"""The console shows the phase that runs while it runs (portrl/progress.py), not only after a step."""

import threading
import time

from portrl.progress import Heartbeat, activity, describe, note
from portrl.trainer.metrics import Timer


def test_describe_names_the_open_phases_and_their_time():
    assert describe() == ""
    timer = Timer()
    with timer("step"):
        with timer("gen"):
            assert describe(step=3, now=time.monotonic() + 42) == "step 3 > gen 42s (step 42s)"
        with activity("validation") as entry:
            entry[2] = "8/45 prompts done"
            assert describe(now=time.monotonic() + 75).startswith("step > validation 8/45 prompts done 1m15s")
    assert describe() == ""


def test_the_heartbeat_shows_a_running_phase_within_its_period():
    shown = []
    seen = threading.Event()

    def show(text):
        shown.append(text)
        seen.set()

    beat = Heartbeat(show, lambda: 1, every_s=0.05)
    try:
        time.sleep(0.2)
        assert shown == []  # nothing open: nothing shown
        with activity("step"), activity("gen"):
            assert seen.wait(5)
    finally:
        beat.stop()
    assert shown[0].startswith("step 1 > gen ")


def test_an_activity_left_from_another_thread_is_removed_by_identity():
    outer = activity("step")
    outer.__enter__()
    inner = activity("gen")
    inner.__enter__()
    outer.__exit__(None, None, None)  # closed out of order (another thread's phase)
    assert describe().startswith("gen ")
    inner.__exit__(None, None, None)
    assert describe() == ""


def test_note_sets_the_innermost_phases_detail():
    note("ignored")  # no phase open: nothing to set
    with activity("step"), activity("gen"):
        note("token 300/1024")
        assert describe(step=1).startswith("step 1 > gen token 300/1024 ")
