"""What ``infeng compile`` shows while it works (docs/performance.md "Compile time"): each pass by
name, the steps of a long one with their counts (tensors searched), the C build's units; nothing
under ``--quiet`` or off a terminal."""
from __future__ import annotations

from infeng_cli.app import progress_bar
from infeng_compiler.compile import CompileOptions, run_pipeline


def test_passes_and_their_steps_report_progress(stories_dir) -> None:
    stages: list[str] = []
    counts: list[tuple[int, int]] = []
    run_pipeline(stories_dir, CompileOptions(quant="int8"), stage=stages.append,
                 progress=lambda done, total: counts.append((done, total)))
    assert stages == ["pass cast-weights", "pass quantize", "quantize: search", "pass fuse-linears",
                      "pass plan-memory"]
    total = counts[-1][1]
    assert total > 1 and counts == [(i, total) for i in range(1, total + 1)]


def test_the_display_is_silent_under_quiet_and_off_a_terminal() -> None:
    assert progress_bar(quiet=True).disable
    assert progress_bar().disable                 # pytest's stderr is not a terminal
