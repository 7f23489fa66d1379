"""A bare training loop that stands in for timm's ``train.py`` and ``benchmark.py`` in ``make
bench-peers --tiny`` (``benchmarks/peers.py``): it takes the arguments the harness gives them and
prints what the harness reads from them (``train.py``'s ``Train:`` lines; ``benchmark.py``'s
``--result`` JSON), so that the harness runs in the test suite on a CPU without a timm checkout.
It is a plain PyTorch loop (torchvision's ImageFolder and transforms, a timm model), not timm's code.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import timm
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.transforms import v2


def train(args: argparse.Namespace) -> None:
    """Epochs of an ImageFolder, logging every ``--log-interval`` steps as timm's train.py does."""
    transform = v2.Compose([v2.PILToTensor(), v2.RandomResizedCrop(args.img_size, antialias=True),
                            v2.RandomHorizontalFlip(), v2.ColorJitter(args.color_jitter, args.color_jitter,
                                                                      args.color_jitter),
                            v2.ToDtype(torch.float32, scale=True)])
    loader = DataLoader(ImageFolder(f"{args.data_dir}/{args.train_split}", transform), batch_size=args.batch_size,
                        shuffle=True, num_workers=args.workers, drop_last=True, persistent_workers=args.workers > 0)
    model = timm.create_model(args.model, num_classes=args.num_classes).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    per_epoch = len(loader)
    for epoch in range(args.epochs):
        start = ready = time.time()
        for index, (images, labels) in enumerate(loader):
            data = time.time() - ready
            images, labels = images.to(args.device), labels.to(args.device)
            loss = F.cross_entropy(model(images), labels, label_smoothing=args.smoothing)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            now = time.time()
            step_time, start = now - start, now
            if index % args.log_interval == 0 or index == per_epoch - 1:
                print(f"Train: {epoch} [{index:>4d}/{per_epoch} ({100 * (index + 1) / per_epoch:>3.0f}%)]  "
                      f"Loss: {loss.item():#.3g}  Time: {step_time:.3f}s, {len(images) / step_time:>7.2f}/s  "
                      f"Data: {data:.3f} ({data:.3f})", flush=True)
            ready = time.time()


def benchmark(args: argparse.Namespace) -> None:
    """Training steps on a synthetic batch; images/s as benchmark.py's ``--result`` reports it."""
    model = timm.create_model(args.model, img_size=args.img_size).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters())
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=args.device)
    labels = torch.zeros(args.batch_size, dtype=torch.long, device=args.device)
    for count in (1, 3):  # a warm-up step, then the timed ones
        start = time.perf_counter()
        for _ in range(count):
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
    print(f"--result\n{json.dumps({'model': args.model, 'train_samples_per_sec': 3 * args.batch_size / seconds})}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench")
    parser.add_argument("--data-dir")
    parser.add_argument("--train-split", default="train")
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-classes", type=int)
    parser.add_argument("--img-size", type=int, required=True)
    parser.add_argument("-b", "--batch-size", type=int, required=True)
    parser.add_argument("-j", "--workers", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--smoothing", type=float, default=0.0)
    parser.add_argument("--color-jitter", type=float, default=0.0)
    parser.add_argument("--device", default="cpu")
    args, _ = parser.parse_known_args(argv)  # the settings a bare loop has no use for (--opt, --amp, ...)
    if args.bench:
        benchmark(args)
    else:
        train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
