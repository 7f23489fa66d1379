"""`make prep-fashion_mnist`: local copies verified by content, clear errors when nothing works."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import UserError
from data_prep import fashion_mnist as prep
from tests.conftest import REPO
from tools.tiny_data import write_fashion_mnist


def run_prep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data_prep.fashion_mnist", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def debian_dir() -> Path:
    if not prep.DEBIAN_DIR.is_dir():
        reason = f"{prep.DEBIAN_DIR} is missing: apt-get install dataset-fashion-mnist"
        if os.environ.get("REQUIRE_FASHION_MNIST") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return prep.DEBIAN_DIR


def test_prepares_the_real_files_from_debian_and_then_keeps_them(debian_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fashion_mnist"
    first = run_prep("--source", str(debian_dir), "--out", str(out))
    assert first.returncode == 0, first.stderr
    assert sorted(path.name for path in out.iterdir()) == sorted(prep.FILES)
    assert prep.is_prepared(out)
    second = run_prep("--out", str(out))
    assert second.returncode == 0 and "already prepared" in second.stdout


def test_gzipped_files_with_the_wrong_content_are_refused(tmp_path: Path) -> None:
    raw = write_fashion_mnist(tmp_path / "raw")
    gz = tmp_path / "gz"
    gz.mkdir()
    for file in raw.iterdir():
        (gz / f"{file.name}.gz").write_bytes(gzip.compress(file.read_bytes()))
    result = run_prep("--source", str(gz), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    line, = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "is not Fashion-MNIST's" in line
    assert not (tmp_path / "out").exists(), "nothing may be written from an unverified source"


def test_a_missing_source_folder_is_one_line(tmp_path: Path) -> None:
    result = run_prep("--source", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: source folder {tmp_path / 'nowhere'} does not exist"]


def test_with_no_source_at_all_the_error_says_how_to_get_the_data(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(url: str, destination: Path, md5: str | None = None) -> Path:
        raise UserError(f"could not download {url}: network unreachable")

    monkeypatch.setattr(prep, "DEBIAN_DIR", tmp_path / "no-debian-package")
    monkeypatch.setattr(prep, "download", offline)
    with pytest.raises(UserError) as error:
        prep.prepare(tmp_path / "out")
    message = str(error.value)
    assert "apt-get install dataset-fashion-mnist" in message
    assert "SOURCE=" in message and "\n" not in message
