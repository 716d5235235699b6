"""The agent's word to its device plugin that the offers are withdrawn (gpunode.host.standdown):
the plugin, told to stop, serves on until that word is newer than its own SIGTERM, never
longer than its grace, and takes no other pod's or boot's word for it."""

from __future__ import annotations

import json
import time

from support.hostkit import make_host

from gpunode.host import standdown


def test_a_word_written_after_the_signal_counts_and_an_old_one_does_not(tmp_path):
    host = make_host(tmp_path, [])
    signalled = time.time()
    assert not standdown.withdrawn_since(host, signalled)  # none written yet
    standdown.tell_withdrawn(host, clock=lambda: signalled - standdown.SLACK - 60)  # another pod's, a minute back
    assert not standdown.withdrawn_since(host, signalled)
    standdown.tell_withdrawn(host)
    assert standdown.withdrawn_since(host, signalled)


def test_a_word_of_another_boot_does_not_count(tmp_path):
    host = make_host(tmp_path, [])
    path = host.path(standdown.WITHDRAWN)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"boot": "another-boot", "at": time.time()}))
    assert not standdown.withdrawn_since(host, time.time())


def test_the_wait_is_bounded(tmp_path):
    host = make_host(tmp_path, [])
    started = time.monotonic()
    assert not standdown.wait_withdrawn(host, time.time(), 0.3, every=0.05)
    assert time.monotonic() - started < 2
