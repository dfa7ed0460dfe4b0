"""The stderr progress bar: a redrawn line on a TTY, throttled log lines elsewhere."""

from __future__ import annotations

import io

from kvstore.cli.progress import ProgressBar


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_tty_redraws_one_line():
    buf, clock = io.StringIO(), _Clock()
    bar = ProgressBar(buf, tty=True, width=10, clock=clock)
    for i in range(0, 101):
        clock.t = i * 0.05
        bar("verify", i, 100)
    bar.close()
    text = buf.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert "\r" in text and "[##########] 100/100" in text
    assert text.count("\r") < 60  # throttled to interval_s


def test_log_lines_when_not_a_tty():
    buf, clock = io.StringIO(), _Clock()
    bar = ProgressBar(buf, tty=False, clock=clock, log_interval_s=2.0)
    for i in range(0, 101):
        clock.t = i * 0.1  # 10 s in all: start, ~every 2 s, end
        bar("verify", i, 100)
    bar("verify", 100, 100)  # a repeated final step prints nothing more
    bar("orphans", 0, 0)
    lines = buf.getvalue().splitlines()
    assert "\r" not in buf.getvalue()
    assert lines[0] == "kvtool: verify: 0/100 (0%)" and "verify: 100/100 (100%)" in lines[-2]
    assert 5 <= len(lines) <= 8 and lines[-1] == "kvtool: orphans: nothing to do"
    bar.close()
    assert buf.getvalue().count("\n") == len(lines)
