"""CIFAR-100, python version: the original tarball, md5-checked and extracted safely.

    python -m data_prep.cifar100_resnet50 [--source FILE_OR_DIR] [--out data/cifar100]

Where the tarball comes from:
1. ``--source FILE``: ``cifar-100-python.tar.gz`` itself, or ``--source DIR``: a folder holding it;
2. otherwise the original download from the University of Toronto.
Either way its md5 must be the published one. Only the three pickles (``train``, ``test``,
``meta``) are extracted, as plain files, into ``<out>/cifar-100-python/``; both splits are then
read back with the recipe's reader. A folder that already holds a verified extraction is left
as it is. ``dinov2_fsdp`` reads the same folder.
"""

from __future__ import annotations

import argparse
import shutil
import tarfile
from pathlib import Path

from common.data import cifar100
from common.errors import UserError
from data_prep.files import download, file_digest, run_cli, write_bytes_atomic

URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
TARBALL = "cifar-100-python.tar.gz"
TARBALL_MD5 = "eb9058c3a382ffc7106e4002c42a8d85"
MEMBERS = ("train", "test", "meta")  # the files of cifar-100-python/ the readers need
VERIFIED_MARKER = ".verified_md5"  # written last: the md5 of the tarball the folder came from
HOW_TO_GET = f"download {URL} and run `make prep-cifar100_resnet50 SOURCE=<the .tar.gz or its folder>`"


def is_prepared(out: Path, md5: str = TARBALL_MD5) -> bool:
    marker = out / cifar100.FOLDER / VERIFIED_MARKER
    return marker.is_file() and marker.read_text().strip() == md5


def find_tarball(source: Path) -> Path:
    """``source`` itself if it is a file, else ``source/cifar-100-python.tar.gz``."""
    if source.is_file():
        return source
    if source.is_dir():
        if (source / TARBALL).is_file():
            return source / TARBALL
        raise UserError(f"{source} has no {TARBALL}")
    raise UserError(f"source {source} does not exist")


def verify_md5(tarball: Path, md5: str) -> None:
    actual = file_digest(tarball)
    if actual != md5:
        raise UserError(f"{tarball}: md5 {actual} is not the CIFAR-100 tarball's {md5} (corrupt or a different file)")


def extract(tarball: Path, out: Path, md5: str) -> None:
    """Extract the three pickles as regular files; reject anything else the archive claims they are."""
    folder = out / cifar100.FOLDER
    staging = out / f".{cifar100.FOLDER}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with tarfile.open(tarball, "r:gz") as archive:
            for name in MEMBERS:
                try:
                    member = archive.getmember(f"{cifar100.FOLDER}/{name}")
                except KeyError as error:
                    raise UserError(f"{tarball} has no {cifar100.FOLDER}/{name}") from error
                if not member.isfile():
                    raise UserError(f"{tarball}: {member.name} is not a regular file")
                handle = archive.extractfile(member)
                write_bytes_atomic(staging / name, handle.read())
    except (tarfile.TarError, OSError, EOFError) as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise UserError(f"{tarball} is not a readable .tar.gz ({error})") from error
    for split in cifar100.SPLITS:
        cifar100.load_split(staging, split)  # a UserError here names the bad pickle
    (staging / VERIFIED_MARKER).write_text(md5 + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


def prepare(out: Path, source: Path | None = None, md5: str = TARBALL_MD5) -> str:
    """Make ``out/cifar-100-python`` hold the verified pickles; return where they came from."""
    if source is not None:
        tarball = find_tarball(source)
        verify_md5(tarball, md5)
        extract(tarball, out, md5)
        return str(tarball)
    if is_prepared(out, md5):
        return "already prepared"
    tarball = out / "downloads" / TARBALL
    if not (tarball.is_file() and file_digest(tarball) == md5):
        try:
            download(URL, tarball, md5=md5)
        except UserError as error:
            raise UserError(f"{error}; {HOW_TO_GET}") from error
    extract(tarball, out, md5)
    return URL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help=f"{TARBALL} or a folder that holds it")
    parser.add_argument("--out", type=Path, default=Path("data/cifar100"))
    args = parser.parse_args()
    origin = prepare(args.out, args.source)
    train = cifar100.load_split(args.out, "train")
    test = cifar100.load_split(args.out, "test")
    print(f"cifar100_resnet50: {args.out / cifar100.FOLDER} holds {len(train.labels)} train and "
          f"{len(test.labels)} test images ({origin})")


if __name__ == "__main__":
    run_cli(main)
