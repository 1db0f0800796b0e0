"""Running a call on another thread for the threading tests."""

import threading


def run_in_thread(fn, name="worker"):
    """Run ``fn`` in a new thread named ``name`` and join it: ``(box, thread)``, ``box`` holding
    what it returned (``"value"``) or raised (``"error"``)."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:   # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, name=name)
    t.start()
    t.join(30)
    assert not t.is_alive()
    return box, t
