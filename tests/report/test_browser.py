"""The HTML report in a real browser: headless Chromium (Debian's `chromium` package) renders
it; the screenshot is not blank and the page logs nothing to the console.

Chromium is not a Python dependency: where /usr/bin/chromium (or `chromium` on the PATH) is
missing, these tests skip, saying so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from magis.commands.report import report

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (no /usr/bin/chromium): apt-get install chromium "
    "runs the HTML report's browser tests",
)

# A closed network and no desktop session: no background requests, no GPU, no sandbox (root).
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
)
# What Chromium logs of each console message: `...:INFO:CONSOLE:12] "text", source: URL (12)`
# (older versions: `CONSOLE(12)`).
CONSOLE = re.compile(r':CONSOLE(?::\d+|\(\d+\))\] "(.*)", source: ')
SECTIONS = ("summary", "timeline", "breakdown", "explain", "pareto", "measured")


def chromium(page: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    """Run headless Chromium on `page` with a fresh profile under `work`."""
    profile = work / f"profile-{len(list(work.glob('profile-*')))}"
    profile.mkdir(parents=True)
    return subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )


def console_messages(stderr: str) -> list[str]:
    return CONSOLE.findall(stderr)


def screenshot(page: Path, work: Path, size=(1000, 2400)) -> Path:
    shot = work / f"{page.stem}.png"
    done = chromium(page, work, f"--window-size={size[0]},{size[1]}", f"--screenshot={shot}")
    assert shot.exists(), done.stderr[-2000:]
    return shot


def blank(png: Path) -> bool:
    """True when the image is (nearly) one colour: fewer than 1% of its pixels differ from the
    most common one, or it has fewer than 8 colours."""
    from PIL import Image

    with Image.open(png) as im:
        rgb = im.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 24)
    top = max(count for count, _ in colours)
    total = rgb.width * rgb.height
    return len(colours) < 8 or (total - top) < total * 0.01


def test_the_checks_catch_a_console_error_and_a_blank_page(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text(
        '<!DOCTYPE html><html><head><link rel="icon" href="data:,"></head><body>'
        '<script>console.error("boom"); no_such_function();</script></body></html>'
    )
    messages = console_messages(chromium(bad, tmp_path, "--dump-dom").stderr)
    assert "boom" in messages and any("no_such_function" in m for m in messages)
    assert blank(screenshot(bad, tmp_path, (400, 300)))


def test_the_report_renders_in_chromium_without_console_errors(plan_file, tmp_path):
    page = tmp_path / "report.html"
    report(plan_file, page)
    dom = chromium(page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert console_messages(dom.stderr) == []
    for section in SECTIONS:
        assert f'<section id="{section}">' in dom.stdout
    assert dom.stdout.count("<svg") == 3
    shot = screenshot(page, tmp_path)
    assert not blank(shot)
    from PIL import Image

    with Image.open(shot) as im:
        assert im.size == (1000, 2400)
        # the memory figure (below the summary table) is drawn: its plot area holds the
        # curves' colours
        colours = {c for _, c in im.convert("RGB").crop((0, 250, 1000, 800)).getcolors(1 << 24)}
    assert (0x4E, 0x79, 0xA7) in colours and (0xE1, 0x57, 0x59) in colours
