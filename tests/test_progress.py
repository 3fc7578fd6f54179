"""Progress: one renderer for `moed generate` and `moed run`; plain lines when not a terminal,
one line redrawn in place on a terminal; `moed run` draws the daemon's Progress replies."""

from __future__ import annotations

import io
import os
import tempfile

from daemon.cli import main
from daemon.progress import COMPILING, Progress, Renderer
from ipc.protocol import Chunk, Done, Generate
from ipc.protocol import Progress as ProgressReply
from ipc.testing import MockServer


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


REPORTS = [("build", 0.0, ""), ("build", 5.0, "a"), ("build", 12.5, "b"), ("build", 100.0, ""),
           ("compile", None, COMPILING), ("compile", None, COMPILING), ("load", 50.0, "reading")]


def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()
    render = Renderer(out)
    for report in REPORTS:
        render(*report)
    render.close()
    assert out.getvalue().splitlines() == ["building demo MoE: 0%", "building demo MoE: 12% b",
                                           "building demo MoE: 100%", f"compiling: {COMPILING}", "loading: 50% reading"]


def test_one_line_redrawn_in_place_on_a_terminal():
    out = Terminal()
    render = Renderer(out)
    for report in REPORTS:
        render(*report)
    render.close()
    text = out.getvalue()
    assert text.count("\r") == len(REPORTS) and text.endswith("\n")
    lines = text.split("\n")  # a phase's redraws share a line; a new phase starts a new one
    assert len(lines) == 4 and "100%" in lines[0] and COMPILING in lines[1] and "reading" in lines[2]


def test_progress_counts_steps_into_reports():
    reports = []
    bar = Progress("load", 4, report=lambda *r: reports.append(r))
    bar.step("reading")
    bar.close()
    assert reports == [("load", 0.0, ""), ("load", 25.0, "reading"), ("load", 100.0, "")]


def test_a_part_of_a_step_reports_between_it_and_the_next():
    reports = []
    bar = Progress("load", 4, report=lambda *r: reports.append(r))
    bar("reading")  # a call is a step (Engine.load's progress)
    bar("uploading")
    bar.part(0.5, "1.0/2.0 GB")
    bar.part(2.0, "past the end")  # clamped to the step's end
    bar("building")
    assert reports[1:] == [("load", 25.0, "reading"), ("load", 50.0, "uploading"), ("load", 62.5, "1.0/2.0 GB"),
                           ("load", 75.0, "past the end"), ("load", 75.0, "building")]


def test_moed_run_draws_the_daemons_progress_as_plain_lines(capsys):
    def handler(req):
        if isinstance(req, Generate):
            return [ProgressReply(req.id, "build", 40.0, "calibration text 5/12"),
                    ProgressReply(req.id, "compile", None, COMPILING), Chunk(req.id, "Hello", [1]), Done(req.id)]
        return []

    path = os.path.join(tempfile.mkdtemp(prefix="moed-"), "moed.sock")
    with MockServer(handler, path).in_thread():
        assert main(["run", "--socket", path, "Hi"]) == 0
    out = capsys.readouterr()
    assert out.out == "Hello\n"
    assert out.err.splitlines() == ["building demo MoE: 40% calibration text 5/12", f"compiling: {COMPILING}"]
