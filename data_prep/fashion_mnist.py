"""Fashion-MNIST: the four original IDX files, decompressed and checksum-verified.

    python -m data_prep.fashion_mnist [--source DIR] [--out data/fashion_mnist]

Where the files come from, in order:
1. ``--source DIR``: a folder with the four files, gzipped or not (only this, when given);
2. Debian's ``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``);
3. the original download (the ``.gz`` files are md5-checked).
Whatever the source, the decompressed content must match the md5 sums below; a folder that
already holds verified files is left as it is.
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path

from common.errors import UserError
from data_prep.files import bytes_digest, download, file_digest, run_cli, write_bytes_atomic

DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
# name: (md5 of the original .gz download, md5 of the decompressed IDX content)
FILES = {
    "train-images-idx3-ubyte": ("8d4fb7e6c68d591d4c3dfef9ec88bf0d", "f4a8712d7a061bf5bd6d2ca38dc4d50a"),
    "train-labels-idx1-ubyte": ("25c81989df183df01b3e8a0aad5dffbe", "9018921c3c673c538a1fc5bad174d6f9"),
    "t10k-images-idx3-ubyte": ("bef4ecab320f06d8554ea6380940ec79", "8181f5470baa50b63fa0f6fddb340f0a"),
    "t10k-labels-idx1-ubyte": ("bb300cfdad3c16e7a12a480ee83cd310", "15d484375f8d13e6eb1aabb0c3f46965"),
}
HOW_TO_GET = (
    "get Fashion-MNIST with `apt-get install dataset-fashion-mnist` (Debian/Ubuntu) and rerun, "
    f"or download the four .gz files from {URL} and run `make prep-fashion_mnist SOURCE=<folder>`"
)


def is_prepared(out: Path) -> bool:
    return all((out / name).is_file() and file_digest(out / name) == content for name, (_, content) in FILES.items())


def _read_source_file(folder: Path, name: str) -> bytes:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            data = candidate.read_bytes()
            try:
                return gzip.decompress(data) if candidate.suffix == ".gz" else data
            except (OSError, EOFError) as error:
                raise UserError(f"{candidate} is not a valid gzip file ({error})") from error
    raise UserError(f"{folder} has no {name} or {name}.gz")


def copy_from(folder: Path, out: Path) -> None:
    """Decompress (if needed), verify and write the four files from a local folder."""
    if not folder.is_dir():
        raise UserError(f"source folder {folder} does not exist")
    verified = {}
    for name, (_, content_md5) in FILES.items():
        data = _read_source_file(folder, name)
        if bytes_digest(data) != content_md5:
            raise UserError(f"{folder}/{name}: content md5 {bytes_digest(data)} is not Fashion-MNIST's {content_md5}")
        verified[name] = data
    for name, data in verified.items():
        write_bytes_atomic(out / name, data)


def download_to(out: Path) -> None:
    downloads = out / "downloads"
    for name, (gz_md5, _) in FILES.items():
        target = downloads / f"{name}.gz"
        if not (target.is_file() and file_digest(target) == gz_md5):
            download(URL + f"{name}.gz", target, md5=gz_md5)
    copy_from(downloads, out)


def prepare(out: Path, source: Path | None = None) -> str:
    """Make ``out`` hold the verified files; return where they came from."""
    if source is not None:
        copy_from(source, out)
        return str(source)
    if is_prepared(out):
        return "already prepared"
    if DEBIAN_DIR.is_dir():
        copy_from(DEBIAN_DIR, out)
        return str(DEBIAN_DIR)
    try:
        download_to(out)
    except UserError as error:
        raise UserError(f"no local copy of Fashion-MNIST and {error}; {HOW_TO_GET}") from error
    return URL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="folder with the four files (.gz or raw)")
    parser.add_argument("--out", type=Path, default=Path("data/fashion_mnist"))
    args = parser.parse_args()
    origin = prepare(args.out, args.source)
    print(f"fashion_mnist: {args.out} holds the verified IDX files ({origin})")


if __name__ == "__main__":
    run_cli(main)
